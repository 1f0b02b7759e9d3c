"""GGUF Studio's core: engine, supervision, admission and the OpenAI-compatible port.

Never imports Qt: the headless `gguf-studio serve` runs exactly this.  Four rooms over a
small base; imports only go down (app → port, models → llama → base):

- `backend.keys`: named keys, their usage, teammates' enrolment requests;
- `backend.llama`: the engine (build, supervise, report, KV rules, the load contract);
- `backend.models`: GGUF files, the hub, downloads, fit;
- `backend.port`: the OpenAI-compatible port and its admission;
- `backend.app`: the service, command line, self-test, snippets, activity, desktop;
- the base, here: settings, API keys, errors, listeners, the event loop, addresses, the
  C heap (`heap`: large blocks given back when freed), TOML values written by hand
  (`toml_text`).
"""
