"""The `gguf-studio` command line.

    gguf-studio                      open the window (see `launcher`)
    gguf-studio engine status|build|path
    gguf-studio inspect MODEL [--json]
    gguf-studio serve [--model [NAME=]MODEL]... [--upstream URL]... [--models-file FILE] [options]
    gguf-studio rpc-worker [--host H --port P]   lend this machine to an engine elsewhere (RPC)
    gguf-studio search [TEXT]        GGUF repositories on Hugging Face (none: the curated list)
    gguf-studio pull REPO[:QUANT|FILE]
    gguf-studio hf-token [--forget]  save a Hugging Face token for gated repositories
    gguf-studio keys add|list|edit|revoke   named API keys with limits (one per person or agent)
    gguf-studio requests [--follow] [--json] [--port P | --url URL]   the port's recent requests
    gguf-studio keys requests|approve|refuse   teammates asking for a key (`connect`)
    gguf-studio connect [NAME|URL]   get a key from a port on the LAN, set up Codex and OpenCode

Here: `main`, the parser, and `serve`, which runs the service; the other commands are
`backend.app.commands`' (and `connect` the sharing room's, the self-test and the desktop
entry the app's).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import Any, Sequence

from backend import event_loop
from backend.api_keys import read_api_key_file
from backend.keys.enrolment_window import MAX_ACCEPT_MINUTES, accepting_until
from backend.errors import StudioError
from backend.llama.chat_template import (ChatTemplate, TemplateSource, check_chat_template,
                                         resolved_chat_template)
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import THREADS_HELP, LoadSettings
from backend.models.hf_cache import printable, printable_lines
from backend.settings import API_KEY_FILE_ENV, PLACEMENTS, UPSTREAM_KV_LAYOUTS, Settings, env_var
from backend.url_credentials import hide_url_credentials, hide_url_credentials_in_logs
from backend.app.commands.cli_engine import add_engine_parsers, add_rpc_worker_parser
from backend.app.commands.cli_hub import add_hub_parsers
from backend.app.commands.cli_keys import add_key_parsers
from backend.app.commands.cli_requests import add_requests_parser
from backend.app.sharing.connect import add_connect_parser
from backend.app.pool.models_file import read_models_file
from backend.app.pool.pool_config import ModelEntry, PoolConfig, UpstreamEntry


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if not getattr(args, "verbose", False) else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    hide_url_credentials_in_logs()  # an upstream's http://user:password@host
    if args.command is None:  # the window is the launcher's (`launcher.main`)
        parser.print_help()
        return 2
    try:
        code: int = args.run(args)  # each command's run, set with set_defaults
        return code
    except StudioError as exc:
        print(f"gguf-studio: {printable_lines(str(exc))}", file=sys.stderr)
        tail = getattr(exc, "log_tail", "")
        if tail:
            print("--- last lines of the log ---\n" + tail.rstrip(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# --- serve ----------------------------------------------------------------------------------

# Command-line options that map one to one onto settings.
_SERVE_SETTINGS = ("host", "port", "api_key", "allow_no_key", "allow_origins", "allow_hosts",
                   "max_queue", "queue_timeout", "keepalive_interval", "max_output_tokens",
                   "default_output_tokens", "max_body_bytes", "max_waiting_body_bytes",
                   "max_incoming_body_bytes", "max_prompt_counts",
                   "client_stall_timeout", "max_connections", "header_timeout",
                   "reload_grace", "resend_grace",
                   "llama_server", "parallel", "ctx_size", "n_gpu_layers", "threads",
                   "load_timeout", "models_file", "rpc", "otel_endpoint", "otel_client_parent",
                   "allow_enrolment",
                   "stall_budget_ms", "chat_template", "placement")


def _serve(args: argparse.Namespace) -> int:
    settings = serve_settings(args)
    # A key kept in a file stays there: --save never copies it into settings.json.
    file_key = read_api_key_file(args.api_key_file) if args.api_key_file else None
    config = pool_config(args, settings)
    missing = [m for m in config.models if not os.path.isfile(m.path)]
    if missing:
        raise StudioError("No GGUF file at " + "; ".join(
            f"{printable(m.path, 4096)} (model {printable(m.name)})" for m in missing) + ".")
    if args.rpc and not config.models:
        raise StudioError("--rpc spreads a model this machine loads (--model) over workers; "
                          "an --upstream engine has its own.")
    if args.save:
        settings.save()
    if file_key is not None:
        settings = settings.replace(api_key=file_key)
    try:
        return event_loop.run(_serve_async(settings, config))
    except KeyboardInterrupt:
        return 0


def serve_settings(args: argparse.Namespace) -> Settings:
    """The settings `serve ARGS` runs with: saved, then the environment, then the flags;
    the first model and upstream of the flags remembered as the last load."""
    overrides = {name: getattr(args, name) for name in _SERVE_SETTINGS}
    if args.models_file:
        overrides["models_file"] = os.path.abspath(os.path.expanduser(args.models_file))
    if args.model:
        overrides["model"] = os.path.abspath(os.path.expanduser(_named_path(args.model[0])[1]))
    if args.upstream:
        overrides["upstream"] = args.upstream[0]
    if args.upstream_kv and len(args.upstream_kv) == 1:
        overrides["upstream_kv"] = args.upstream_kv[0]
    if args.advertise is not None:
        overrides["advertise"] = True
        if args.advertise:
            overrides["advertise_name"] = args.advertise
    if args.accept_enrolments is not None:
        overrides["accept_enrolments_until"] = accepting_until(args.accept_enrolments)
    if args.chat_template is not None:
        overrides["chat_template"] = resolved_chat_template(args.chat_template, os.getcwd())
        check_chat_template(overrides["chat_template"], as_given=args.chat_template)
    settings = Settings.load().with_overrides(overrides)
    if args.extra_arg:
        settings = settings.replace(extra_args=list(args.extra_arg))
    return settings


def pool_config(args: argparse.Namespace, settings: Settings) -> PoolConfig:
    """What `serve ARGS` serves: the models file (--models-file, else the settings'),
    with the models and upstreams of the flags added.  Without any, the last load
    (the saved or exported model or upstream), as before there were several."""
    load = LoadSettings.last_load(settings)
    models = [ModelEntry.for_file(os.path.abspath(os.path.expanduser(path)), name, settings=load)
              for name, path in map(_named_path, args.model or ())]
    models += [ModelEntry.for_file(os.path.abspath(os.path.expanduser(path)), name,
                                   settings=dataclasses.replace(load, chat_template=""),
                                   embeddings=True)
               for name, path in map(_named_path, args.embeddings_model or ())]
    urls = list(args.upstream or ())
    from_file = read_models_file(settings.models_file) if settings.models_file else PoolConfig()
    if not models and not urls and not from_file.models and not from_file.upstreams:
        if settings.upstream:
            urls = [settings.upstream]
        elif settings.model:
            models = [ModelEntry.for_file(settings.model, settings=load)]
    flags = PoolConfig(tuple(models), _upstreams(args, settings, urls), args.default_model,
                       args.memory_limit or 0)
    config = from_file.merge(flags)
    if not config.models and not config.upstreams:
        raise StudioError("Give a model with --model PATH, a models file with --models-file FILE, "
                          "or a running llama-server with --upstream URL.")
    return config


def _upstreams(args: argparse.Namespace, settings: Settings, urls: list[str]) -> tuple[UpstreamEntry, ...]:
    """The flags' upstreams, each with its key and KV layout given in the same order."""
    keys: list[str] = args.upstream_api_key or []
    key_files: list[str] = args.upstream_api_key_file or []
    layouts: list[str] = args.upstream_kv or []
    given = "--upstream-api-key-file" if key_files else "--upstream-api-key"
    if (keys or key_files or layouts) and not urls:
        raise StudioError(f"{given if keys or key_files else '--upstream-kv'} goes with --upstream URL; "
                          "an upstream of the models file has its api_key_file and kv_layout there.")
    if (keys or key_files) and len(keys or key_files) != len(urls):
        raise StudioError(f"Give one {given} per --upstream, in the same order ('' for one that "
                          f"needs none): {len(urls)} upstream(s), {len(keys or key_files)} key(s).")
    if len(layouts) > 1 and len(layouts) != len(urls):
        raise StudioError("Give one --upstream-kv for every upstream, or one per --upstream in "
                          f"the same order: {len(urls)} upstream(s), {len(layouts)} layouts.")
    upstreams = []
    for i, url in enumerate(urls):
        layout = KvLayout.parse(layouts[i] if len(layouts) > 1 else layouts[0] if layouts
                                else settings.upstream_kv)
        if key_files:
            upstreams.append(UpstreamEntry.with_key_file(url, key_files[i] or None, layout))
        else:
            upstreams.append(UpstreamEntry(url, keys[i] if keys and keys[i] else None, layout))
    return tuple(upstreams)


def _named_path(text: str) -> tuple[str | None, str]:
    """`NAME=PATH` -> (NAME, PATH); a plain path (one that exists, or with no name before
    an =) -> (None, PATH)."""
    name, sep, path = text.partition("=")
    if sep and name and path and "/" not in name and os.sep not in name and not os.path.exists(text):
        return name, path
    return None, text


async def _serve_async(settings: Settings, config: PoolConfig) -> int:
    from backend.app.service import StudioService
    from backend.llama.load import Snapshot, State

    service = StudioService(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass

    def report(model: str, snapshot: Snapshot) -> None:
        if snapshot.state is State.STOPPED and model in service.pool.names():
            # Stopped here is unloaded or evicted in the pool: say so, and what brings it back.
            status = service.pool.status(model)
            print(printable_lines(f"[{status.residency.value}] {model}"
                                   + (f": {status.decision}" if status.decision else "")), flush=True)
            return
        line = f"[{snapshot.state.value}] {snapshot.model_id or model}"
        serving = snapshot.serving
        if serving is not None:
            line += f": effective parallel slots {serving.slots}"
            if serving.context_length:
                line += f", context {serving.context_length} per slot"
            if serving.kv is not None:
                line += f"; KV cache: {serving.kv.describe(serving.slots)}"
            if snapshot.engine:
                line += f"; runs on {snapshot.engine.summary()}"
            if serving.kv_note:
                line += f"\n  {serving.kv_note} (--upstream-kv split|unified)"
            if serving.prefix_warning:
                line += f"\n  {serving.prefix_warning}"
            line += _template_report(service.pool.status(model).chat_template
                                     if model in service.pool.names() else None)
        if snapshot.error:
            line += f": {snapshot.error}"
        # Model names and errors come from files and other servers: shown escaped.
        print(printable_lines(hide_url_credentials(line)), flush=True)

    service.pool.add_listener(report)  # every model's engine, not only the default's
    try:
        urls = await service.start_gateway()
        print("OpenAI-compatible base URL" + ("s" if len(urls) > 1 else "") + ":", flush=True)
        for url in urls:
            print(f"  {url}", flush=True)
        if settings.advertise:
            asyncio.ensure_future(_say_announced(service))
        if settings.api_key or service.keys.requires_keys():
            print(service.enrolment_window().describe(), flush=True)
        start = asyncio.create_task(service.start_pool(config))
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            start.result()
        else:
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
        await stop.wait()
        print("stopping", flush=True)
        return 0
    finally:
        await service.close()


def _template_report(template: ChatTemplate | None) -> str:
    """The load report's words on a ready model's chat template: a warning when it has
    none, the owner's pick when it has one; nothing for the model's own."""
    if template is None or template.source is TemplateSource.OWN:
        return ""
    if not template.takes_chats:
        return f"\n  {template.warning()}"
    return f"; chat template: {template.describe()}"


async def _say_announced(service: Any) -> None:
    """One line once the port is announced on the LAN (or why it is not)."""
    await service.announced()
    if service.advertiser.renamed:
        print(f"Warning: {service.announcement()}", flush=True)
    elif service.advertiser.running:
        print(f"Announced on the LAN as {service.advertiser.name!r}: teammates run "
              f"gguf-studio connect", flush=True)
    elif service.advertise_problem:
        print(service.advertise_problem, flush=True)


# --- argument parsing -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gguf-studio",
                                description="Share a local GGUF model on your network.")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(command=None)
    sub = p.add_subparsers(dest="command")

    add_engine_parsers(sub)

    from backend.app import desktop_entry

    from backend.app import self_test
    for name, fn, text in (("install-desktop", desktop_entry.cli_install,
                            "add GGUF Studio to the desktop's application menu (Linux)"),
                           ("uninstall-desktop", desktop_entry.cli_uninstall,
                            "remove what install-desktop wrote")):
        d = sub.add_parser(name, help=text)
        desktop_entry.add_arguments(d)
        d.set_defaults(run=fn)

    add_hub_parsers(sub)
    add_key_parsers(sub)
    add_requests_parser(sub)
    add_connect_parser(sub)

    st = sub.add_parser("self-test", help="load MODEL, answer one request through the port, exit")
    st.add_argument("model", metavar="MODEL")
    self_test.add_arguments(st)
    st.set_defaults(run=lambda args: asyncio.run(self_test.run_self_test(
        args.model, llama_server=args.llama_server, ctx_size=args.ctx_size, timeout=args.timeout)))

    serve = sub.add_parser("serve", help="run headless: engines + OpenAI-compatible port")
    env = env_var
    serve.add_argument("--model", action="append", metavar="[NAME=]PATH",
                       help="GGUF file to serve, requested by NAME (default: the file name "
                       "without .gguf); repeatable: the models run side by side")
    serve.add_argument("--embeddings-model", action="append", metavar="[NAME=]PATH",
                       help="GGUF embeddings model to serve on /v1/embeddings (repeatable)")
    serve.add_argument("--models-file", metavar="FILE",
                       help="TOML file of models (per-model context, slots, GPU layers, aliases, "
                       f"pinned, idle TTL) and upstreams with their keys; flags add to it "
                       f"({env('models_file')})")
    serve.add_argument("--upstream", action="append", metavar="URL",
                       help="a running llama-server or GGUF Studio port to serve through this "
                       "port (repeatable)")
    serve.add_argument("--default-model", metavar="NAME",
                       help="the model for requests that name none (default: the first)")
    serve.add_argument("--memory-limit", type=int, metavar="MIB",
                       help="memory the loaded models may take together, in MiB (default: "
                       "the machine's RAM, and VRAM where models are offloaded)")
    serve.add_argument("--host", help=f"address to listen on (default 127.0.0.1; {env('host')})")
    serve.add_argument("--port", type=int, help=f"port to listen on (default 8899; {env('port')})")
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help=f"key clients must send ({env('api_key')}); "
                      "visible to other local users in the process list, see --api-key-file")
    keys.add_argument("--api-key-file", metavar="PATH",
                      help="read the key clients must send from this file, so that it never "
                      f"appears in the process list ({API_KEY_FILE_ENV}; not saved by --save)")
    serve.add_argument("--upstream-kv", choices=UPSTREAM_KV_LAYOUTS, action="append",
                       help="how the --upstream llama-server's KV cache is laid out, which it "
                       "cannot report: split (each slot its own share, its default with -np N) "
                       "or unified (--kv-unified); unstated, one shared pool of one slot's "
                       "context is assumed, which limits concurrency. Once for every "
                       f"upstream, or once per --upstream in the same order ({env('upstream_kv')})")
    upstream_keys = serve.add_mutually_exclusive_group()
    upstream_keys.add_argument("--upstream-api-key", metavar="KEY", action="append",
                               help="the key the --upstream llama-server requires (its --api-key); "
                               "one per --upstream in the same order, '' for none; visible to "
                               "other local users in the process list, see --upstream-api-key-file")
    upstream_keys.add_argument("--upstream-api-key-file", metavar="PATH", action="append",
                               help="read the --upstream's key from this file (kept out of the "
                               "process list); one per --upstream in the same order, '' for none")
    serve.add_argument("--allow-no-key", action="store_true", default=None,
                       help="listen beyond loopback without a key (anyone can use the model)")
    serve.add_argument("--allow-origin", dest="allow_origins", action="append", metavar="ORIGIN",
                       help="let web pages of this origin use the port, e.g. "
                       "https://chat.example.com or https://*.example.com (repeatable; "
                       f"{env('allow_origins')}, comma-separated)")
    serve.add_argument("--allow-host", dest="allow_hosts", action="append", metavar="NAME",
                       help="accept this host name without a key, besides the machine's own "
                       f"names and addresses (repeatable; {env('allow_hosts')})")
    serve.add_argument("--advertise", nargs="?", const="", metavar="NAME",
                       help="announce the port on the LAN over mDNS under NAME (default: this "
                       "machine's name), so teammates find it with `gguf-studio connect`; only "
                       f"while it listens beyond loopback with keys required ({env('advertise')})")
    serve.add_argument("--no-enrolment", dest="allow_enrolment", action="store_false",
                       default=None, help="take no enrolment requests (`gguf-studio connect`) "
                       f"from teammates ({env('allow_enrolment')}=0)")
    serve.add_argument("--accept-enrolments", type=float, metavar="MINUTES",
                       help="take teammates' enrolment requests (`gguf-studio connect`) for "
                       f"MINUTES from now (at most {MAX_ACCEPT_MINUTES}; 0 closes); without "
                       "it, only while the port is announced (--advertise)")
    serve.add_argument("--parallel", help="parallel slots: auto or N (default auto)")
    serve.add_argument("--ctx-size", type=int, help="context size, 0 = the model's (default 0)")
    serve.add_argument("--n-gpu-layers", help="layers on the GPU: auto (what fits; default), all, none or N")
    serve.add_argument("--threads", type=int, help=f"CPU threads, 0 = {THREADS_HELP}")
    serve.add_argument("--max-queue", type=int, help="waiting places, 0 = 16 x slots, at least 64")
    serve.add_argument("--queue-timeout", type=float, help="seconds a request may wait, 0 = no limit (600)")
    serve.add_argument("--placement", choices=PLACEMENTS, help="where a session's turns go among a "
                       "model's engines: back to its prefix (keep-prefixes, the default) or to its "
                       "engine on a consistent-hash ring (hash-ring); a model's own in the models file")
    serve.add_argument("--keepalive-interval", type=float, help="seconds between keep-alives while queued (5)")
    serve.add_argument("--max-output-tokens", type=int, help="default and ceiling for output tokens, 0 = off")
    serve.add_argument("--otel-endpoint", metavar="URL",
                       help="export each request as an OpenTelemetry span to this OTLP/HTTP "
                       "endpoint, e.g. http://collector:4318/v1/traces (needs the otel extra; "
                       f"{env('otel_endpoint')})")
    serve.add_argument("--otel-client-parent", action="store_true", default=None,
                       help="a client's traceparent makes the request's span a child of the "
                       "client's span (its trace) instead of a link from a trace of the port's "
                       f"own; for clients you trace too ({env('otel_client_parent')}=1)")
    serve.add_argument("--default-output-tokens", type=int,
                       help="output tokens reserved for a request that sends no limit (2048)")
    serve.add_argument("--max-body-bytes", type=int, help="largest request body, 0 = default (32 MiB)")
    serve.add_argument("--max-waiting-body-bytes", type=int,
                       help="bytes of bodies requests waiting in line may hold together, "
                       "0 = no bound (256 MiB)")
    serve.add_argument("--max-incoming-body-bytes", type=int,
                       help="bytes of bodies being read, parsed and counted at once, before "
                       f"they queue, 0 = no bound (64 MiB; {env('max_incoming_body_bytes')})")
    serve.add_argument("--max-prompt-counts", type=int,
                       help="prompt counts asked of a model's engines at once, 0 = twice their slots "
                       f"({env('max_prompt_counts')})")
    serve.add_argument("--client-stall-timeout", type=float,
                       help="seconds a client may leave its answer unread before it is "
                       f"dropped and its slot freed, 0 = never (120; {env('client_stall_timeout')})")
    serve.add_argument("--max-connections", type=int,
                       help="connections the port keeps open at once (512)")
    serve.add_argument("--header-timeout", type=float,
                       help="seconds a client may take to send a request head or the next "
                       "part of its body; the whole body gets this plus 1 s per KiB (30)")
    serve.add_argument("--reload-grace", type=float, help="seconds running requests get on reload (30)")
    serve.add_argument("--resend-grace", type=float,
                       help="seconds a request whose client hung up before its answer began "
                       "keeps its place and its engine's work, for the same request sent again "
                       f"to join it, 0 = cut at once (30; {env('resend_grace')})")
    serve.add_argument("--load-timeout", type=float, help="seconds a load may take (300)")
    serve.add_argument("--stall-budget", dest="stall_budget_ms", type=float, metavar="MS",
                       help="longest a stream may wait for one step beside a prompt; sets "
                            "the engine's batch size, 0 = the engine's own (250)")
    serve.add_argument("--llama-server", help="llama-server binary to use")
    serve.add_argument("--rpc", metavar="HOST:PORT,...",
                       help="spread the model over these machines, each running `gguf-studio "
                       "rpc-worker` (trusted wired network only; llama.cpp's RPC is insecure) "
                       f"({env('rpc')})")
    serve.add_argument("--chat-template", metavar="NAME|FILE",
                       help="the chat template of the --model models: one of llama.cpp's "
                       "built-in templates (chatml, gemma, llama3, ...; chatml and files take "
                       "tools), a Jinja template file, or none (plain completion only); "
                       "default: the model's own. A model without one takes no chat requests "
                       f"({env('chat_template')})")
    serve.add_argument("--extra-arg", action="append", metavar="ARG",
                       help="extra llama-server argument (repeatable)")
    serve.add_argument("--save", action="store_true", help="remember these options as settings")
    serve.set_defaults(run=_serve)

    add_rpc_worker_parser(sub)

    return p


if __name__ == "__main__":
    sys.exit(main())
