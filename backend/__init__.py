"""GGUF Studio's core: the engine, the models, admission, the OpenAI-compatible port and the
application around them.

Never imports Qt: the headless `gguf-studio serve` runs exactly this.  Rooms over a small
base, each importing only the rooms before it (`tests/test_layers.py`):

- `backend.keys`: who may use the port: named keys, their usage, teammates' enrolment
  requests;
- `backend.llama`: the engine (build, supervise, report, KV rules, the load contract);
- `backend.models`: GGUF files, the hub, downloads, fit;
- `backend.admission`: who is served next, where, and with how much of an engine; no
  sockets;
- `backend.port`: the OpenAI-compatible port (routes, keys, the relay, metrics); it asks
  admission and does the I/O;
- `backend.app`: the service the window and the command line drive, the pool, the command
  line, sharing with a teammate;
- the base, here: settings (`settings`: saved file < environment < command line), the
  owner's API key (`api_keys`), the API's paths (`api_paths`), every error raised on
  purpose (`errors`), the GPU-layers and RPC-workers settings (`gpu_layers`,
  `rpc_workers`), callbacks that all hear one event (`listeners`), news that changes often
  reaching its readers a few times a second (`throttle`), the event loop (`event_loop`),
  this machine's addresses (`addresses`), files private to the user (`private_files`),
  credentials kept out of logged URLs (`url_credentials`), the C heap (`heap`: large
  blocks given back when freed), TOML values written by hand (`toml_text`), and memory as
  people read it (`memory_size`).
"""
