"""The `draftlab` command. Each command parses and validates its arguments, then calls one
library function; bad input exits with status 2 and one clear message, never a traceback.
`docs/cli.md` is generated from `build_parser()` (`draftlab.cli_parser`; `draftlab generate`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from draftlab import docs, infra, submit
from draftlab.cli_parser import QUICK, build_parser, package_version
from draftlab.config import (
    BenchConfig,
    ConfigError,
    DistillConfig,
    DoctorConfig,
    LoadtestConfig,
    NgramSpec,
    ProfileConfig,
    ServeArgs,
    TargetSpec,
    VllmBenchSpec,
    apply_dotted,
    format_validation_error,
    load_yaml,
    parse_overrides,
)
from draftlab.errors import DraftlabError
from draftlab.report import write_report
from draftlab.serve import control
from draftlab.storage import local_copy
from draftlab.tracking import format_runs_table, list_runs, promote

__all__ = ["build_parser", "main", "package_version"]


def _target(a: argparse.Namespace) -> TargetSpec:
    return TargetSpec(
        name=a.target, device=a.device, dtype=a.dtype, trust_remote_code=a.trust_remote_code
    )


def _distill(a: argparse.Namespace) -> None:
    from draftlab.distill.launch import format_summary, run_distill  # noqa: PLC0415 -- torch, Ray

    cfg = load_yaml(DistillConfig, a.config, parse_overrides(a.overrides))
    print(format_summary(run_distill(cfg)))


def _select_tree(a: argparse.Namespace) -> None:
    from draftlab.distill.tree_select import choose_tree_for_run  # noqa: PLC0415 -- torch

    cfg = load_yaml(DistillConfig, a.config, parse_overrides(a.overrides))
    report = choose_tree_for_run(cfg, a.drafter)
    for c in report["candidates"]:
        ngram = c.get("ngram")
        lookups = (
            ""
            if not ngram
            else (
                f" +lookups ({ngram['store_tokens']} from the store, paths carried on by "
                f"{ngram['extend']} from depth {ngram['extend_from']}) in {c['lookup_rounds']:.0%} "
                "of rounds"
            )
        )
        print(
            f"{c['nodes']:3d} nodes, depth {c['depth']}{lookups}: replayed tau {c['tau']:.3f}, "
            f"verify {c['verify_ms']:.1f} ms, predicted speedup {c['predicted_speedup']:.3f}"
        )
    print(
        f"decode step {report['decode_ms']:.1f} ms; chosen: {report['chosen']} (saved as tree.json)"
    )


def _sweep(a: argparse.Namespace) -> None:
    from draftlab.sweep.runner import format_table, resume_sweep, run_sweep  # noqa: PLC0415 -- Tune

    if bool(a.config) == bool(a.resume):
        raise ConfigError(
            "give exactly one of -c SWEEP.yaml (a new sweep) or --resume PATH (an interrupted one)"
        )
    if a.resume and a.overrides:
        raise ConfigError(
            "--resume continues the sweep as it was defined: overrides are not allowed"
        )
    summary = (
        resume_sweep(a.resume, not a.quiet)
        if a.resume
        else run_sweep(a.config, parse_overrides(a.overrides), not a.quiet)
    )
    print(format_table(summary))
    best, champ = summary.get("best"), summary.get("champion")
    if best:
        print(
            f"best: K={best['k']} depth={best['depth']} tree={best['tree']}: tau "
            f"{best['tau']:.3f}, speedup_vs_ar {best['speedup_vs_ar']:.3f} (MLflow run "
            f"{best['mlflow_run_id']})"
        )
    if champ:
        print(f"champion: {champ['model']} version {champ['version']} @{champ['alias']}")
    print(f"wall {summary['wall_s']:.0f} s; results in {summary['experiment_dir']}/results")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _promote(a: argparse.Namespace) -> None:
    out = promote(a.run_id, a.model, a.alias, a.tracking_uri)
    was = f" (was version {out['previous']}, kept)" if out["previous"] else ""
    print(
        f"{out['model']} version {out['version']} (run {out['run_id']}) is now @{out['alias']}{was}"
    )


def _serve(a: argparse.Namespace) -> None:
    from draftlab.serve.vllm_app import VllmServeArgs  # noqa: PLC0415 -- Ray Serve

    if a.status or a.shutdown:
        print(json.dumps(control.status(), indent=2) if a.status else control.shutdown(a.name))
        return
    if a.config and (a.model_uri or a.drafter or a.target):
        raise ConfigError(
            "give either -c SERVE_CONFIG or --model-uri / --target / --drafter, not both"
        )
    if a.model_uri and a.drafter:
        raise ConfigError("give --model-uri or --drafter, not both")
    if a.config:
        spec = control.load_serve_config(a.config)
    else:
        # Ray Serve
        from draftlab.serve.app import build_app  # noqa: PLC0415
        from draftlab.serve.vllm_app import build_vllm_app  # noqa: PLC0415

        builder, args = (
            (build_vllm_app, VllmServeArgs()) if a.engine == "vllm" else (build_app, ServeArgs())
        )
        spec = {
            "builder": builder,
            "args": args,
            "name": control.DEFAULT_APP,
            "route_prefix": "/",
            "host": "127.0.0.1",
            "port": 8000,
        }
    vllm = isinstance(spec["args"], VllmServeArgs)
    if a.engine and a.engine != ("vllm" if vllm else "draftlab"):
        raise ConfigError(
            f"{a.config} serves with --engine {'vllm' if vllm else 'draftlab'}, not --engine "
            f"{a.engine}"
        )
    if vllm and a.tree:
        raise ConfigError(
            "--tree needs --engine draftlab: vLLM verifies a chain of num_speculative_tokens"
        )
    flags = {
        "model_uri": a.model_uri,
        "drafter": a.drafter,
        "tracking_uri": a.tracking_uri,
        "engine.tree": a.tree,
        ("speculation" if vllm else "engine.speculation"): a.speculation,
    } | ({"target.name": a.target} if a.target else {})
    data = apply_dotted(
        spec["args"].model_dump(exclude_unset=True),
        {k: v for k, v in flags.items() if v is not None} | parse_overrides(a.overrides),
    )
    spec["args"] = type(spec["args"]).model_validate(data)
    spec |= {
        k: v for k, v in {"host": a.host, "port": a.port, "name": a.name}.items() if v is not None
    }
    control.deploy(spec, blocking=False if a.detach else None)


def _loadtest(a: argparse.Namespace) -> None:
    from draftlab.serve.loadtest import run_loadtest  # noqa: PLC0415 -- httpx

    cfg = LoadtestConfig(
        url=a.url,
        model=a.model,
        api_key=a.api_key,
        concurrency=a.concurrency,
        requests=a.requests,
        rounds=a.rounds,
        speculation=a.speculation,
        prompts=a.prompts,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        stream=not a.no_stream,
        json_out=a.json_out,
        duration_s=a.duration,
        window_s=a.window,
        warmup=a.warmup,
    )
    print(json.dumps(run_loadtest(cfg), indent=2))


def _pipeline(a: argparse.Namespace) -> None:
    from draftlab.pipeline.runner import format_summary, run_pipeline  # noqa: PLC0415 -- torch, Ray

    if bool(a.config) == a.quick:
        raise ConfigError("give exactly one of -c PIPELINE.yaml or --quick")
    overrides = parse_overrides(a.overrides) | ({"prompts": a.prompts} if a.prompts else {})
    summary = run_pipeline(a.config or QUICK, overrides, progress=not a.quiet)
    print(format_summary(summary))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _submit(a: argparse.Namespace) -> None:
    env = dict(item.split("=", 1) for item in a.env if "=" in item)
    if len(env) != len(a.env):
        raise ConfigError("--env takes KEY=VALUE")
    job_id = submit.submit(a.kind, a.config, a.overrides, a.address, a.pip, env)
    print(
        f"submitted {a.kind} job {job_id}\n  draftlab jobs logs {job_id} --follow\n"
        f"  draftlab jobs stop {job_id}"
    )
    if a.follow:
        submit.logs(job_id, a.address, follow=True)
        print(submit.status(job_id, a.address))


def _jobs(a: argparse.Namespace) -> None:
    if a.action == "list":
        print(submit.format_jobs(submit.list_jobs(a.address)))
        return
    if not a.job_id:
        raise ConfigError(f"jobs {a.action} needs a job id (see `draftlab jobs list`)")
    if a.action == "logs":
        submit.logs(a.job_id, a.address, a.follow)
    else:
        print((submit.status if a.action == "status" else submit.stop)(a.job_id, a.address))


def _report(a: argparse.Namespace) -> None:
    out = write_report(a.source, a.out, a.tracking_uri, log=not a.no_log)
    print(
        f"wrote {out['html']} and {out['markdown']}"
        + (f"; logged to MLflow run {out['logged_to']}" if out["logged_to"] else "")
    )


def _generate(a: argparse.Namespace) -> None:
    changed = docs.regenerate(a.check) + infra.regenerate(a.check)
    if a.check and changed:
        raise ConfigError(
            f"stale generated files (run `draftlab generate`): {', '.join(map(str, changed))}"
        )
    print(
        "\n".join(f"{'stale' if a.check else 'wrote'} {c}" for c in changed)
        or "generated files are up to date"
    )


def _runs(a: argparse.Namespace) -> None:
    print(format_runs_table(list_runs(a.tracking_uri, a.experiment, a.limit)))


def _export(a: argparse.Namespace) -> None:
    from draftlab.export import (  # noqa: PLC0415 -- torch
        export_vllm,
        served_draft_length,
        vllm_speculative_config,
    )

    out = export_vllm(a.drafter, a.out)
    k = served_draft_length(local_copy(a.drafter))
    print(f"wrote {out}; vLLM: speculative_config={json.dumps(vllm_speculative_config(out, k))}")


def _bench(a: argparse.Namespace) -> None:
    from draftlab.bench import render_table, run_bench  # noqa: PLC0415 -- torch

    cfg = BenchConfig(
        target=_target(a),
        drafter=a.drafter,
        prompts=a.prompts,
        limit=a.limit,
        max_new_tokens=a.max_new_tokens,
        k=a.k,
        depth=a.depth,
        tree=a.tree,
        trees=a.trees,
        versus=a.versus,
        temperature=a.temperature,
        top_p=a.top_p,
        seed=a.seed,
        warmup=a.warmup,
        passes=a.passes,
        methods=a.methods,
        json_out=a.json_out,
        ngram=NgramSpec(
            tokens=a.ngram_tokens,
            min_match=a.ngram_min,
            max_match=a.ngram_max,
            store_tokens=a.ngram_store_tokens,
            grow_to=a.ngram_grow_to,
            extend=a.ngram_extend,
        ),
        vllm=VllmBenchSpec(
            side_by_side=not a.vllm_one_at_a_time,
            memory_fraction=a.vllm_memory_fraction,
            enforce_eager=not a.vllm_compile,
            draft_lengths=a.vllm_draft_lengths,
            suffix_draft_lengths=a.vllm_suffix_draft_lengths,
        ),
        concurrency=a.concurrency,
        load_all=a.load_all,
    )
    report = run_bench(cfg)
    print(render_table(report))
    if cfg.json_out:
        print(f"wrote {cfg.json_out}")


def _profile(a: argparse.Namespace) -> None:
    from draftlab.profiling import run_profile  # noqa: PLC0415 -- torch

    lists = {
        name: getattr(a, name)
        for name in ("new_tokens", "trees", "depths", "ks")
        if getattr(a, name) is not None
    }
    cfg = ProfileConfig(
        target=_target(a), context=a.context, repeats=a.repeats, json_out=a.json_out, **lists
    )
    print(json.dumps(run_profile(cfg), indent=2))


def _doctor(a: argparse.Namespace) -> None:
    from draftlab.doctor import run_doctor  # noqa: PLC0415 -- torch, transformers

    given = {
        "checks": a.checks,
        "target": a.target,
        "identity_shape": a.identity_shape,
        "speed_shape": a.speed_shape,
        "dtypes": a.dtypes,
        "contexts": a.contexts,
        "new_tokens": a.new_tokens,
        "acceptance": a.acceptance,
        "json_out": a.json_out,
    }
    cfg = DoctorConfig(
        device="cuda" if a.gpu else a.device, **{k: v for k, v in given.items() if v is not None}
    )
    out = open(cfg.json_out, "w") if cfg.json_out else None  # noqa: SIM115 -- closed below

    def emit(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if out is not None:
            out.write(text + "\n")
            out.flush()

    try:
        lines = run_doctor(cfg, emit)
    finally:
        if out is not None:
            out.close()
    failed = [line["check"] for line in lines if "error" in line]
    if failed:
        raise DraftlabError(f"checks failed: {', '.join(failed)} (their lines say why)")


COMMANDS = {
    "bench": _bench,
    "profile": _profile,
    "doctor": _doctor,
    "distill": _distill,
    "select-tree": _select_tree,
    "sweep": _sweep,
    "promote": _promote,
    "runs": _runs,
    "serve": _serve,
    "loadtest": _loadtest,
    "pipeline": _pipeline,
    "submit": _submit,
    "jobs": _jobs,
    "report": _report,
    "generate": _generate,
    "export": _export,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may also follow options (`submit distill -c X train.lr=1`)
    overrides = [e for e in extra if "=" in e and not e.startswith("-")]
    if hasattr(args, "overrides") and overrides:
        args.overrides += overrides
        extra = [e for e in extra if e not in overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        COMMANDS[args.command](args)
    except ValidationError as e:
        print(
            f"draftlab {args.command}: " + format_validation_error(e, "command-line options"),
            file=sys.stderr,
        )
        return 2
    except (
        ConfigError,
        DraftlabError,
        ValueError,
        KeyError,
        FileNotFoundError,
        OSError,
        NotImplementedError,
        ConnectionError,
    ) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"draftlab {args.command}: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
