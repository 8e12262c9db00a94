"""`draftlab serve`: deploy, inspect and stop the application on a Ray cluster.

    draftlab serve -c serving/smollm2-135m.yaml      a Serve config file (as `serve deploy` takes)
    draftlab serve --model-uri models:/NAME@champion
    draftlab serve --target tiny-llama --drafter init:parallel
    draftlab serve --status | --shutdown

The cluster is `RAY_ADDRESS`, else one already running on this machine (`ray start --head`,
or another `draftlab serve`), else a local instance started here; with that local instance
the command stays in the foreground (Ctrl-C stops it), like `serve run`.

Ray (and `serve.vllm_app`, which imports Ray Serve) is imported by the functions that talk to
the cluster: `draftlab --help` (cli), `draftlab generate` (infra) and the pipeline's compose
import this module to validate serving files.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import time
from pathlib import Path
from typing import get_type_hints

from pydantic import BaseModel, ValidationError

from draftlab.config import ConfigError, format_validation_error, read_mapping
from draftlab.serve.pair import model_version

DEFAULT_APP = "draftlab"


def load_serve_config(path: str | Path) -> dict:
    """A Serve config file's first draftlab application and http options, args validated
    (errors name the file and the field)."""
    doc = read_mapping(path)
    apps = doc.get("applications")
    if not isinstance(apps, list) or not apps:
        raise ConfigError(f"{path}: expected an `applications:` list (a Ray Serve config file)")
    app = apps[0]
    import_path = app.get("import_path", "")
    if ":" not in import_path:
        raise ConfigError(
            f"{path}: applications[0].import_path must be module:builder, got {import_path!r}"
        )
    module, attr = import_path.split(":", 1)
    try:
        builder = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{path}: import_path {import_path!r} is not importable ({e})") from None
    model = builder_args(builder, f"{path}: import_path {import_path!r}")
    try:
        args = model.model_validate(app.get("args") or {})
    except ValidationError as e:
        raise ConfigError(
            format_validation_error(e, f"{path}: applications[0].args", model)
        ) from None
    http = doc.get("http_options") or {}
    return {
        "builder": builder,
        "args": args,
        "name": app.get("name", DEFAULT_APP),
        "route_prefix": app.get("route_prefix", "/"),
        "host": http.get("host", "127.0.0.1"),
        "port": int(http.get("port", 8000)),
    }


def builder_args(builder, where: str = "builder") -> type[BaseModel]:
    """The args model of a typed builder (`build_app(args: ServeArgs)`, `build_vllm_app(args:
    VllmServeArgs)`): its parameter's annotation, as Serve reads it for `args:`."""
    hints = {k: v for k, v in get_type_hints(builder).items() if k != "return"}
    model = next(iter(hints.values()), None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ConfigError(
            f"{where} is not a typed draftlab builder (its argument is no pydantic model)"
        )
    return model


def connect(start_local: bool) -> bool:
    """Join RAY_ADDRESS or a running cluster; else start a local one if allowed. Returns
    True when this process started (and so owns) the instance."""
    import ray  # noqa: PLC0415 -- Ray: see the module docstring

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address or "auto", log_to_driver=False)
        return False
    except ConnectionError:
        if address or not start_local:
            raise ConfigError(
                f"no Ray cluster at {address or 'this machine'}: start one (`ray start --head`) or "
                "run `draftlab serve` without --status/--shutdown"
            ) from None
    ray.init(include_dashboard=False)
    return True


def deploy(spec: dict, blocking: bool | None = None, progress: bool = True) -> dict:
    """Deploy `spec` (from `load_serve_config` or the CLI flags); returns URL and status.
    `blocking` None = stay in the foreground only if this process started the cluster."""
    from ray import serve  # noqa: PLC0415 -- Ray: see the module docstring

    from draftlab.serve.vllm_app import VllmServeArgs  # noqa: PLC0415 -- Ray Serve

    vllm = isinstance(spec["args"], VllmServeArgs)  # Ray Serve LLM's app: no `info` method
    if spec["args"].drafter is None and not (
        vllm and (spec["args"].speculation == "off" or spec["args"].method != "drafter")
    ):
        model_version(
            spec["args"]
        )  # fail here, clearly, rather than in every replica's constructor
    owns = connect(start_local=True)
    serve.start(http_options={"host": spec["host"], "port": spec["port"]})
    t0 = time.perf_counter()
    if progress:
        print(
            f"deploying {spec['name']} (loading the target and drafter on each replica)...",
            flush=True,
        )
    handle = serve.run(
        spec["builder"](spec["args"]), name=spec["name"], route_prefix=spec["route_prefix"]
    )
    info = {"model": spec["args"].model_id} if vllm else handle.info.remote().result()
    url = f"http://{spec['host']}:{spec['port']}{spec['route_prefix'].rstrip('/')}"
    out = {
        "url": f"{url}/v1",
        "app": spec["name"],
        "model": info["model"],
        "ready_s": round(time.perf_counter() - t0, 1),
    }
    if progress:
        args = spec["args"]
        print(
            f"ready in {out['ready_s']} s: {out['url']} serving {info['model']!r}\n"
            + example_curl(url, info["model"], args.auth_enabled),
            flush=True,
        )
    if blocking if blocking is not None else owns:
        if progress:
            print(
                "serving in the foreground: Ctrl-C stops it (`draftlab serve --status` from "
                "another shell)"
            )
        _wait_for_interrupt()
        serve.shutdown()
    return out


def _wait_for_interrupt() -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass


def example_curl(url: str, model: str, auth: bool) -> str:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 32}
    )
    key = ' -H "Authorization: Bearer $DRAFTLAB_API_KEY"' if auth else ""
    return f"curl {url}/v1/chat/completions{key} -H 'Content-Type: application/json' -d '{body}'"


def status() -> dict:
    """Applications, their deployments and replica counts (needs a running cluster)."""
    from ray import serve  # noqa: PLC0415 -- Ray: see the module docstring

    connect(start_local=False)
    st = serve.status()
    return {
        "proxies": {k: str(v) for k, v in st.proxies.items()},
        "applications": {
            name: {
                "status": str(app.status),
                "message": app.message,
                "deployments": {
                    d: {
                        "status": str(ds.status),
                        "replicas": {str(k): v for k, v in ds.replica_states.items()},
                        "message": ds.message,
                    }
                    for d, ds in app.deployments.items()
                },
            }
            for name, app in st.applications.items()
        },
    }


def shutdown(name: str | None = None) -> str:
    from ray import serve  # noqa: PLC0415 -- Ray: see the module docstring

    connect(start_local=False)
    if name:
        serve.delete(name)
        return f"deleted application {name!r}"
    serve.shutdown()
    return "Serve shut down (the Ray cluster keeps running)"
