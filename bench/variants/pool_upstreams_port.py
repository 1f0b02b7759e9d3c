"""`gguf-studio serve --upstream A --upstream B ...` for a checkout whose `serve` takes
--upstream once but whose service has the pool (`StudioService.attach_upstream` adds an
engine each time): every --upstream after the first is attached through the service,
beside the first.  `bench/pool.py --pool-via-service` starts its N > 1 ports this way
until `serve` takes --upstream more than once itself."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backend.app import service  # noqa: E402
from backend.app.cli import main  # noqa: E402


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv with only the first --upstream, and the URLs of the others."""
    kept, more, seen = [], [], False
    args = iter(argv)
    for arg in args:
        if arg == "--upstream":
            url = next(args)
            if seen:
                more.append(url)
                continue
            seen = True
            kept += [arg, url]
        else:
            kept.append(arg)
    return kept, more


argv, others = _split(sys.argv[1:])
attach_first = service.StudioService.attach_upstream


async def attach_all(self, url, api_key=None, kv_layout=None):  # type: ignore[no-untyped-def]
    snapshot = await attach_first(self, url, api_key=api_key, kv_layout=kv_layout)
    for other in others:
        await attach_first(self, other, api_key=api_key, kv_layout=kv_layout)
    return snapshot


service.StudioService.attach_upstream = attach_all  # type: ignore[method-assign]
sys.exit(main(argv))
