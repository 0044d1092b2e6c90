"""SGLang's frontend language (``sglang.lang``: ``function``, ``gen``, ``select``,
``RuntimeEndpoint``) without the SGLang runtime.

``sglang/__init__.py`` imports the serving runtime (torch CUDA kernels, triton, orjson...);
sglang is installed ``--no-deps`` here. As kvflow.integrations.sglang_contract does, the
package is entered as an unexecuted module object, so that only ``sglang.lang`` and what it
imports run: numpy, requests, tqdm, pybase64, msgspec, aiohttp and IPython (pinned in
constraints.txt)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import SimpleNamespace


def load_frontend() -> SimpleNamespace:
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(
                "sglang is not installed: pip install --no-deps -c constraints.txt sglang"
            )
        sys.modules["sglang"] = importlib.util.module_from_spec(spec)  # not executed
    api = importlib.import_module("sglang.lang.api")
    endpoint = importlib.import_module("sglang.lang.backend.runtime_endpoint")
    return SimpleNamespace(
        function=api.function,
        gen=api.gen,
        select=api.select,
        set_default_backend=api.set_default_backend,
        RuntimeEndpoint=endpoint.RuntimeEndpoint,
    )
