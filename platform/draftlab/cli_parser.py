"""The `draftlab` command's argument parser (`build_parser`), apart from the commands that run
(`draftlab.cli`), so that `draftlab.docs` renders docs/cli.md from it without importing them."""

from __future__ import annotations

import argparse
import tomllib
from importlib import metadata
from pathlib import Path
from typing import get_args

from draftlab.config import NgramSpec, TargetSpec, VllmBenchSpec
from draftlab.submit import DEFAULT_ADDRESS, ENTRYPOINTS

QUICK = "jobs/configs/pipeline-tiny-quick.yaml"  # `draftlab pipeline --quick` (from the repo root)
METHODS = ["ar", "hf_generate", "hf_prompt_lookup", "draftlab_chain", "draftlab_tree"]
PROMPTS_HELP = (
    "a JSONL file of {'prompt'}, chat {'messages'} or Spec-Bench {'turns'} rows, "
    "datasets:<name or file>[:split], or a packaged set: default, heldout, mixed (default: "
    "default; docs/prompts.md)"
)
DEVICES = list(get_args(TargetSpec.model_fields["device"].annotation))  # what TargetSpec accepts
DTYPES = list(get_args(TargetSpec.model_fields["dtype"].annotation))

DESCRIPTION = """\
Speculative decoding with parallel drafters on Ray: distill a drafter from a target LLM
(Ray Train), sweep its draft length, depth and tree shape against measured speedup (Ray
Tune), serve the winner behind an OpenAI-compatible endpoint (Ray Serve, with vLLM or
draftlab's own engine), and log every run to MLflow."""

EPILOG = """\
examples:
  draftlab pipeline -c jobs/configs/pipeline-smollm2-135m-cpu.yaml
      the whole loop on SmolLM2-135M-Instruct (CPU), ending in an endpoint on 127.0.0.1:8000
  draftlab pipeline --quick
      every stage in a few minutes on a tiny random target
  draftlab distill -c jobs/configs/smollm2-135m-parallel-k4.yaml train.lr=3e-4 name=my-run
      train a drafter; key=value arguments override the config's fields
  draftlab bench --drafter DRAFTER_DIR --methods ar,vllm_ar,vllm_suffix,vllm_draftlab \
--concurrency 1,4,16
      measure the contenders in vLLM and print which one to deploy
  draftlab serve -c serving/smollm2-135m-vllm.yaml
      serve the registered champion with vLLM through Ray Serve LLM
  draftlab loadtest --concurrency 1,4,16 --speculation server,off
      the endpoint against target-only decoding on the same server
  draftlab submit --address http://HEAD:8265 distill -c CONFIG --follow
      run a job on a Ray cluster
  draftlab serve --shutdown; ray stop
      stop serving, then the local Ray cluster

`draftlab COMMAND -h` lists a command's options. Reference: docs/cli.md (commands),
docs/configuration.md (config files). A command that cannot do its job prints one line
saying why and exits with status 2."""


def package_version() -> str:
    """The installed distribution's version; in a checkout that is not installed
    (PYTHONPATH=platform), pyproject.toml's."""
    try:
        return metadata.version("draftlab")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


class _VersionAction(argparse.Action):
    """`--version`: the version is looked up only when asked for (argparse's own action takes it
    at parser build, i.e. on every command)."""

    def __init__(
        self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", default="smollm2-135m", help="preset, hub id, local HF dir or .gguf file"
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="where the target runs (auto: cuda when available)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help=(
            "weights dtype (auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else "
            "float32)"
        ),
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model's own code (off by default)",
    )


def _csv(text: str) -> list[str]:
    """A comma list on the command line: `"a, b,"` -> `["a", "b"]`."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(item) for item in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of integers, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftlab",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("bench", help="speed of target-only vs speculative decoding, side by side")
    _target_args(b)
    b.add_argument(
        "--drafter",
        default="init:parallel",
        help="saved drafter dir, or init:parallel / init:autoregressive",
    )
    b.add_argument("--prompts", default=None, help=PROMPTS_HELP)
    b.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    b.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    b.add_argument(
        "--k",
        type=int,
        default=None,
        help="draft length of the chain method (default: the drafter's K)",
    )
    b.add_argument("--depth", type=int, default=1, help="decoder layers of an init: drafter")
    b.add_argument(
        "--tree",
        default=None,
        help=(
            "tree preset, chain-<k>, searched-<n> (the drafter's best n-node tree, from its "
            "tree-search.json), or JSON file of rank paths (default: the drafter dir's tree.json, "
            "else default); @n after it verifies n of its nodes per round, the drafter's "
            "likeliest; +ngram grafts prompt lookups"
        ),
    )
    b.add_argument(
        "--trees",
        type=_csv,
        default="",
        help=(
            "comma list of more trees (as --tree), each benched side by side as a "
            "draftlab_tree:<spec> method"
        ),
    )
    b.add_argument(
        "--versus",
        type=_csv,
        default="",
        help=(
            "comma list of other saved drafters for the same target, each benched with its own "
            "tree.json (or --tree) and lookup store as a draftlab_tree@<path> method, side by side"
        ),
    )
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    b.add_argument("--seed", type=int, default=0, help="sampling seed")
    b.add_argument("--warmup", type=int, default=1, help="untimed prompts per method")
    b.add_argument(
        "--passes",
        type=int,
        default=1,
        help="timed passes over the prompts; with 2 or more the table shows each ratio's range "
        "over the passes (the machine's noise)",
    )
    b.add_argument(
        "--methods",
        type=_csv,
        default=",".join(METHODS),
        help=f"comma list of {', '.join(METHODS)} (the default); "
        "draftlab_chain_ngram, draftlab_tree_ngram (prompt-lookup drafts grafted onto the "
        "chain/tree); vLLM's vllm_ar, vllm_ngram, vllm_suffix (needs arctic-inference), "
        "vllm_draftlab, vllm_draftlab_ngram (not in the default: each vLLM engine starts in tens "
        "of seconds to minutes)",
    )
    b.add_argument(
        "--ngram-tokens",
        type=int,
        default=NgramSpec().tokens,
        help="*_ngram: longest grafted branch",
    )
    b.add_argument(
        "--ngram-min",
        type=int,
        default=NgramSpec().min_match,
        help="*_ngram: shortest suffix n-gram matched",
    )
    b.add_argument(
        "--ngram-max",
        type=int,
        default=NgramSpec().max_match,
        help="*_ngram: longest suffix n-gram matched",
    )
    b.add_argument(
        "--ngram-grow-to",
        type=int,
        default=NgramSpec().grow_to,
        help=(
            "*_ngram in our engine: after a round that commits a whole copy, copy twice as many "
            "tokens next, up to this (<= --ngram-tokens: fixed); vLLM's copies stay --ngram-tokens "
            "long"
        ),
    )
    b.add_argument(
        "--ngram-store-tokens",
        type=int,
        default=NgramSpec().store_tokens,
        help=(
            "*_ngram: longest branch from the drafter's lookup-store (its training responses) "
            "where the text has no match; 0 = text only"
        ),
    )
    b.add_argument(
        "--ngram-extend",
        type=int,
        default=NgramSpec().extend,
        help=(
            "*_ngram in our engine: carry on each prefix of the drafter's likeliest path (and its "
            "next likeliest first token) with up to this many looked-up tokens (text, then store); "
            "0 = off"
        ),
    )
    b.add_argument(
        "--vllm-one-at-a-time",
        action="store_true",
        help="vllm_*: run each vLLM engine alone after ours, one block each (less memory: a large "
        "target on one GPU); by default every engine starts at once and takes its turn on each "
        "prompt beside ours",
    )
    b.add_argument(
        "--vllm-memory-fraction",
        type=float,
        default=VllmBenchSpec().memory_fraction,
        help=(
            "vllm_*: GPU memory share of the vLLM engines together, split among those alive at "
            "once (the bench sizes each KV cache itself; the CPU backend needs no share)"
        ),
    )
    b.add_argument(
        "--vllm-compile",
        action="store_true",
        help="vllm_*: run vLLM's torch.compile'd model, as `draftlab serve` does (each engine "
        "compiles at start-up: minutes on a small CPU); eager by default",
    )
    b.add_argument(
        "--vllm-draft-lengths",
        type=_ints,
        default="",
        help="vllm_draftlab: also measure these k "
        "(< its draft length), one vllm_draftlab@k<n> method each, on the same engine",
    )
    b.add_argument(
        "--vllm-suffix-draft-lengths",
        type=_ints,
        default="8",
        help="vllm_suffix: also measure its drafts capped at these k "
        "(< its depth), one vllm_suffix@k<n> method each, on the same engine",
    )
    b.add_argument(
        "--concurrency",
        type=_ints,
        default="",
        help="vllm_*: also measure each method under load at "
        "these levels (comma list, e.g. 1,4,16) and print the verdict: the configuration to deploy "
        "and its batch-size schedule of draft tokens",
    )
    b.add_argument(
        "--load-all",
        action="store_true",
        help="--concurrency: measure every method under load, not "
        "only the finalists (vllm_ar and the methods faster than it one request at a time)",
    )
    b.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")

    p = sub.add_parser(
        "profile", help="target verify cost and drafter cost on this hardware (JSON)"
    )
    _target_args(p)
    p.add_argument("--context", type=int, default=256, help="cached context length")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per point")
    p.add_argument(
        "--new-tokens",
        type=_ints,
        default=None,
        help="comma list of chain rows to time (default 1,2,4,8,16,32,64)",
    )
    p.add_argument(
        "--trees",
        type=_csv,
        default=None,
        help=(
            "comma list of trees whose verify is timed (chain-<n>, a preset, a JSON file; default "
            "small-6,default,wide-16)"
        ),
    )
    p.add_argument(
        "--depths",
        type=_ints,
        default=None,
        help="comma list of drafter depths to time (default 1,2,3,4)",
    )
    p.add_argument(
        "--ks",
        type=_ints,
        default=None,
        help="comma list of draft lengths K to time (default 1..8)",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")

    dr = sub.add_parser(
        "doctor",
        help="check the engine on this machine's CPU or GPU: identity with margins, "
        "verify and decode costs, a training step (JSON lines)",
        description="Runs with torch, transformers and pydantic alone (no Ray, MLflow, vLLM or "
        "hub): random-weight Llamas of real shapes built in memory, or --target DIR. Without "
        "draftlab installed: PYTHONPATH=platform python -m draftlab doctor [options].",
    )
    dr.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="where the checks run (auto: cuda when available)",
    )
    dr.add_argument("--gpu", action="store_true", help="the same as --device cuda")
    dr.add_argument(
        "--checks",
        type=_csv,
        default=None,
        help="comma list of env,identity,verify,decode,profile,search,train (default all)",
    )
    dr.add_argument(
        "--target",
        default=None,
        help="a local HF model directory checked instead of the random shapes",
    )
    dr.add_argument(
        "--identity-shape",
        default=None,
        help="shape of the identity and train checks' target "
        "(tiny, small, llama-3.2-1b, llama-3.1-8b; default tiny on CPU, llama-3.2-1b on CUDA)",
    )
    dr.add_argument(
        "--speed-shape",
        default=None,
        help="shape of the verify, decode, profile and search checks' target "
        "(default tiny on CPU, llama-3.1-8b on CUDA)",
    )
    dr.add_argument(
        "--dtypes", type=_csv, default=None, help="identity check dtypes (default bfloat16,float32)"
    )
    dr.add_argument(
        "--contexts",
        type=_ints,
        default=None,
        help="verify/decode contexts (default 64 CPU, 512,2048 CUDA)",
    )
    dr.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="greedy tokens per identity prompt and decode run (64)",
    )
    dr.add_argument(
        "--acceptance",
        default=None,
        help="search check: a drafter's tree-search.json or its directory "
        "(default: a packaged SmolLM2-135M drafter's rates)",
    )
    dr.add_argument("--json", dest="json_out", default=None, help="also write the JSON lines here")

    d = sub.add_parser(
        "distill", help="train a drafter by self-distillation on Ray Train (logged to MLflow)"
    )
    d.add_argument("-c", "--config", required=True, help="DistillConfig YAML (see jobs/configs/)")
    d.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 scaling.num_workers=2"
    )

    t = sub.add_parser(
        "select-tree",
        help="re-choose a trained drafter's tree (held-out rank acceptance x measured costs)",
    )
    t.add_argument(
        "-c", "--config", required=True, help="the DistillConfig YAML it was trained with"
    )
    t.add_argument(
        "--drafter", default=None, help="drafter dir (default: the run's, under storage_path/name)"
    )
    t.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. bench.search_budgets=[1,2,4]"
    )

    s = sub.add_parser(
        "sweep",
        help=(
            "Ray Tune sweep of K, depth and tree shape against measured speedup (champion -> "
            "MLflow)"
        ),
    )
    s.add_argument("-c", "--config", default=None, help="sweep YAML (see sweeps/)")
    s.add_argument(
        "--resume",
        default=None,
        metavar="PATH",
        help="continue an interrupted sweep from its directory",
    )
    s.add_argument("--json", dest="json_out", default=None, help="also write the summary here")
    s.add_argument("--quiet", action="store_true", help="no live progress table")
    s.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides of the sweep file, e.g. search.max_concurrent_trials=1",
    )

    m = sub.add_parser(
        "promote", help="make a distillation run's drafter the registered model's champion"
    )
    m.add_argument("run_id", help="MLflow run id of a distillation (see `draftlab runs`)")
    m.add_argument(
        "--model",
        default=None,
        help="registered model name (default: the one the run registered under)",
    )
    m.add_argument(
        "--alias",
        default="champion",
        help="the alias to give the version (the one serving picks up)",
    )
    m.add_argument(
        "--tracking-uri",
        default=None,
        help="default: $MLFLOW_TRACKING_URI or sqlite:///.draftlab/mlflow.db",
    )

    v = sub.add_parser(
        "serve", help="serve a drafter/target pair behind an OpenAI-compatible Ray Serve endpoint"
    )
    v.add_argument("-c", "--config", default=None, help="Serve config file (see serving/)")
    v.add_argument(
        "--engine",
        choices=["draftlab", "vllm"],
        default=None,
        help="draftlab: our engine (trees, "
        "auto policy, exact greedy identity); vllm: vLLM via Ray Serve LLM (P-EAGLE drafters). "
        "Default draftlab, or the -c file's",
    )
    v.add_argument(
        "--model-uri",
        default=None,
        help="MLflow model URI (default: models:/draftlab-<target>-drafter@champion)",
    )
    v.add_argument(
        "--target",
        default=None,
        help="target preset, hub id, local dir or .gguf (with --drafter, or to name the champion)",
    )
    v.add_argument(
        "--drafter", default=None, help="drafter directory or init:<family> instead of a model URI"
    )
    v.add_argument(
        "--tree",
        default=None,
        help="verification tree (default: the drafter's tree.json, else its chain)",
    )
    v.add_argument(
        "--speculation",
        choices=["on", "off", "auto"],
        default=None,
        help="drafting policy (default auto)",
    )
    v.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow of --model-uri (default: $MLFLOW_TRACKING_URI or the local store)",
    )
    v.add_argument(
        "--host", default=None, help="HTTP host (default 127.0.0.1, or the config's http_options)"
    )
    v.add_argument(
        "--port",
        type=int,
        default=None,
        help="HTTP port (default 8000, or the config's http_options)",
    )
    v.add_argument("--name", default=None, help="application name (default 'draftlab')")
    v.add_argument(
        "--detach",
        action="store_true",
        help="return once deployed (needs a running cluster: `ray start --head`)",
    )
    v.add_argument(
        "--status",
        action="store_true",
        help="show the applications, deployments and replicas, then exit",
    )
    v.add_argument(
        "--shutdown",
        action="store_true",
        help="delete the application (--name) or stop Serve, then exit",
    )
    v.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides of the app args, e.g. autoscaling.max_replicas=2",
    )

    lt = sub.add_parser(
        "loadtest", help="closed-loop load on an OpenAI-compatible endpoint (JSON report)"
    )
    lt.add_argument(
        "--url", default="http://127.0.0.1:8000/v1", help="the endpoint's OpenAI base URL"
    )
    lt.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    lt.add_argument("--api-key", default=None, help="Bearer key, when the endpoint has api_keys")
    lt.add_argument(
        "--concurrency", type=_ints, default="1,4,16", help="comma list of concurrency levels"
    )
    lt.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level and mode (default max(prompts, 2 x C))",
    )
    lt.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="timed rounds per level, the modes taking turns (A B, B A, ...); pooled per mode",
    )
    lt.add_argument(
        "--speculation",
        type=_csv,
        default="server",
        help="comma list of modes compared side by side: server,on,off",
    )
    lt.add_argument("--prompts", default=None, help=PROMPTS_HELP)
    lt.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    lt.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    lt.add_argument(
        "--no-stream", action="store_true", help="non-streaming requests (no time to first token)"
    )
    lt.add_argument(
        "--duration",
        type=float,
        default=None,
        help="soak: seconds per level instead of a request count "
        "(adds a per-window latency and replica-memory timeline)",
    )
    lt.add_argument("--window", type=float, default=60.0, help="soak: timeline window in seconds")
    lt.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed requests per speculation mode before the "
        "first level (default: each prompt once, at most 16)",
    )
    lt.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")

    pl = sub.add_parser(
        "pipeline",
        help="the whole loop: data, distill, sweep, promote, compare, serve, smoke, report",
    )
    pl.add_argument(
        "-c", "--config", default=None, help="pipeline YAML (see jobs/configs/pipeline-*.yaml)"
    )
    pl.add_argument(
        "--quick", action="store_true", help=f"a few-minute look on a tiny random target ({QUICK})"
    )
    pl.add_argument(
        "--prompts",
        default=None,
        help="the traffic the compare stage measures on (= prompts=...): "
        "a JSONL file, datasets:<name or file>[:split], or a packaged set (mixed, default, "
        "heldout)",
    )
    pl.add_argument("--json", dest="json_out", default=None, help="also write the summary here")
    pl.add_argument("--quiet", action="store_true", help="no progress output")
    pl.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides of the pipeline file, e.g. sweep.trees=[chain]",
    )

    sb = sub.add_parser(
        "submit", help="submit a distill / sweep / pipeline / bench job to a Ray cluster"
    )
    sb.add_argument("kind", choices=sorted(ENTRYPOINTS), help="which job")
    sb.add_argument(
        "-c", "--config", required=True, help="its YAML config (inside this repo: it is uploaded)"
    )
    sb.add_argument(
        "--address",
        default=None,
        help=f"dashboard URL of the head (default $RAY_ADDRESS or {DEFAULT_ADDRESS})",
    )
    sb.add_argument(
        "--pip",
        action="store_true",
        help="install the project's requirements on the cluster (not torch)",
    )
    sb.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the job",
    )
    sb.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    sb.add_argument("overrides", nargs="*", help="dotted overrides passed to the job")

    jb = sub.add_parser("jobs", help="list / logs / status / stop jobs on a Ray cluster")
    jb.add_argument("action", choices=["list", "logs", "status", "stop"], help="what to do")
    jb.add_argument(
        "job_id",
        nargs="?",
        default=None,
        help="the job (logs, status, stop; see `draftlab jobs list`)",
    )
    jb.add_argument(
        "--address",
        default=None,
        help=f"dashboard URL of the head (default $RAY_ADDRESS or {DEFAULT_ADDRESS})",
    )
    jb.add_argument("--follow", action="store_true", help="logs: stream until the job ends")

    rp = sub.add_parser(
        "report",
        help=(
            "HTML + markdown report of a pipeline, sweep, drafter or MLflow run (logged to MLflow)"
        ),
        description="One self-contained HTML page and its markdown twin. SOURCE is a pipeline "
        "directory (.draftlab/pipelines/NAME), a sweep directory (<storage>/sweeps/NAME), a saved "
        "drafter directory (its training.json: held-out acceptance against training minutes and "
        "tokens, e.g. .draftlab/ray/NAME/drafter), or an MLflow run id (the same files among its "
        "artifacts).",
    )
    rp.add_argument(
        "source", help="pipeline dir, sweep dir, drafter dir (training curve), or MLflow run id"
    )
    rp.add_argument("-o", "--out", default=None, help="output directory (default: <source>/report)")
    rp.add_argument(
        "--tracking-uri",
        default=None,
        help="default: $MLFLOW_TRACKING_URI or sqlite:///.draftlab/mlflow.db",
    )
    rp.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")

    g = sub.add_parser(
        "generate",
        help=(
            "regenerate docs/configuration.md, docs/bench-report.md, docs/cli.md and "
            "infra/k8s/rayservice-*.yaml"
        ),
    )
    g.add_argument(
        "--check", action="store_true", help="write nothing; exit 2 naming the stale files, if any"
    )

    ex = sub.add_parser("export", help="write a p-eagle drafter in vLLM's EAGLE-3 / P-EAGLE layout")
    ex.add_argument("drafter", help="a saved drafter directory (family p-eagle)")
    ex.add_argument("out", help="output directory (replaced)")
    ex.add_argument(
        "--format",
        default="vllm",
        choices=["vllm"],
        help="vllm: speculative_config method eagle3, parallel_drafting",
    )

    r = sub.add_parser("runs", help="recent draftlab runs in MLflow with their key metrics")
    r.add_argument(
        "--experiment", default=None, help="one experiment (default: every draftlab-* experiment)"
    )
    r.add_argument(
        "--tracking-uri",
        default=None,
        help="default: $MLFLOW_TRACKING_URI or sqlite:///.draftlab/mlflow.db",
    )
    r.add_argument("--limit", type=int, default=20, help="most runs listed")
    return parser


# Each command imports its library module when it runs (its `noqa: PLC0415` says what that
# module pulls in): `draftlab --help` and the light commands load no torch, Ray, MLflow or vLLM
# at start-up.
