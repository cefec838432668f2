"""`doel-train verify`: the suite of checks for silent training failures, run on the exact model,
kernels, dtype and compile setting a run will use, with a report (Markdown + JSON, one row a
check: what it checked, the numbers, pass/fail). `fit` runs the fast subset before step 1
through `verify_before_training` and refuses to train on a failure.

The checks live beside this file: base.py (gradient flow), ties.py, parity.py, causal.py,
steps.py (step, accumulation, resume, throughput) and inputs.py (data, tokenizer); what they
run on is what `build_parts` builds for the run.
None leaves a trace: the run's loader is peeked, never consumed; its model is never stepped;
the RNG is forked, so a run with the suite is the run without it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from doel.train.build import Parts, build_parts
from doel.train.checks.base import (
    CheckResult,
    Setup,
    VerifyConfig,
    check_gradients,
    fresh_like,
)
from doel.train.checks.causal import check_causal
from doel.train.checks.inputs import check_data, check_tokenizer_fairness
from doel.train.checks.optim import check_groups
from doel.train.checks.parity import check_parity
from doel.train.checks.steps import (
    check_accumulation,
    check_resume,
    check_step,
    check_throughput,
)
from doel.train.checks.ties import check_ties
from doel.train.common import DoelError, atomic_write_bytes, atomic_write_json
from doel.train.config import resolved
from doel.train.dist import unwrap
from doel.train.settings import TrainConfig

# name -> (check, in the fast subset). The fast subset is what `fit` runs before step 1: a few
# seconds on the tiny preset on CPU. Resume (a checkpoint of the full model written and read)
# and throughput (timing, noisy on a shared machine) run with --full.
CHECKS: dict[str, tuple[Callable[[Setup], CheckResult], bool]] = {
    "gradient_flow": (check_gradients, True),
    "parity": (check_parity, True),
    "ties": (check_ties, True),
    "groups": (check_groups, True),
    "causal": (check_causal, True),
    "step": (check_step, True),
    "accumulation": (check_accumulation, True),
    "resume": (check_resume, False),
    "throughput": (check_throughput, False),
    "data": (check_data, True),
    "tokenizer": (check_tokenizer_fairness, True),
}
SUBSETS = ("fast", "full")
# What `fit` leaves out of its fast subset under torchrun. Parity compares a rank's gradients
# with a local eager pass, but DDP/FSDP average gradients over ranks holding other data, and the
# step check mirrors the optimizer onto a plain model (FSDP's are sharded): both run in
# `doel-train verify` on one process (the recipe's verify stage). Gradient flow and ties
# (identity and shared gradient) run under the wrapper.
SINGLE_PROCESS_ONLY = ("parity", "step")


class VerificationError(DoelError):
    pass


@dataclass
class Report:
    results: list[CheckResult]
    subset: str
    environment: dict
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.passed is not False for r in self.results)

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.passed is False]

    def summary(self) -> str:
        n_pass = sum(r.passed is True for r in self.results)
        n_skip = sum(r.passed is None for r in self.results)
        verdict = "all passed" if self.ok else f"FAILED: {', '.join(self.failed)}"
        return (
            f"verification ({self.subset}, {len(self.results)} checks, {self.seconds:.1f} s): "
            f"{n_pass} passed, {n_skip} skipped; {verdict}"
        )

    def format(self) -> str:
        """A few lines for a log: the summary, then one line per check."""
        rows = [f"  {r.status:<4} {r.name:<13} {r.detail}" for r in self.results]
        return "\n".join([self.summary(), *rows])

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "subset": self.subset,
            "seconds": self.seconds,
            **self.environment,
            "checks": [
                {
                    "name": r.name,
                    "status": r.status,
                    "passed": r.passed,
                    "checked": r.checked,
                    "numbers": _plain(r.numbers),
                    "detail": r.detail,
                    "seconds": r.seconds,
                }
                for r in self.results
            ],
        }

    def markdown(self) -> str:
        env = self.environment
        lines = [
            f"# Verification: {self.summary()}",
            "",
            f"Device {env['device']}, {env['dtype']}, compile={env['compile']}, torch "
            f"{env['torch']}. One row a check; the numbers in full are in `verify.json`.",
            "",
            "| check | status | what it checked | numbers | detail | s |",
            "|---|---|---|---|---|---:|",
        ]
        for r in self.results:
            cells = [r.name, f"**{r.status}**", r.checked, _brief(r.numbers), r.detail]
            cells = [str(c).replace("|", "\\|").replace("\n", " ") for c in cells]
            lines.append("| " + " | ".join(cells) + f" | {r.seconds:.2f} |")
        return "\n".join(lines) + "\n"

    def write(self, out_dir) -> tuple[Path, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "verify.json", self.to_json())
        atomic_write_bytes(out / "verify.md", self.markdown().encode("utf-8"))
        return out / "verify.md", out / "verify.json"


def _plain(x):
    """JSON-safe numbers: NaN and infinities become null, tensors and numpy scalars floats."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _brief(numbers: dict, limit: int = 320) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {fmt(u)}" for k, u in v.items()) + "}"
        if isinstance(v, list) and len(v) > 4:
            return "[" + ", ".join(fmt(u) for u in v[:4]) + ", …]"
        return str(v)

    text = "; ".join(f"{k} {fmt(v)}" for k, v in numbers.items())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def select(subset: str, names: list[str] | None = None) -> list[str]:
    if names:
        unknown = sorted(set(names) - set(CHECKS))
        if unknown:
            raise DoelError(f"unknown checks {unknown}; known: {list(CHECKS)}")
        return list(names)
    if subset not in SUBSETS:
        raise DoelError(f"subset must be one of {SUBSETS}, got {subset!r}")
    return [n for n, (_, fast) in CHECKS.items() if subset == "full" or fast]


def fit_subset(distributed: bool) -> list[str]:
    """The checks `fit` runs before step 1: the fast subset, less SINGLE_PROCESS_ONLY under
    torchrun."""
    return [n for n in select("fast") if not (distributed and n in SINGLE_PROCESS_ONLY)]


def run_checks(setup: Setup, names: list[str], subset: str = "custom", log=None) -> Report:
    """Run the named checks on a Setup. A check that raises is a failed row (naming the error),
    not a crashed suite: a broken model may break a check's own machinery."""
    t0, results = time.perf_counter(), []
    devices = [setup.device] if setup.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for name in names:
            t = time.perf_counter()
            try:
                r = CHECKS[name][0](setup)
            except Exception as e:  # noqa: BLE001 (any error is a finding about the model)
                r = CheckResult(
                    name,
                    "(the check raised)",
                    False,
                    {},
                    f"the check raised {type(e).__name__}: {str(e)[:300]}",
                )
            finally:
                setup.fwd.zero_grad(set_to_none=True)
            r.seconds = time.perf_counter() - t
            results.append(r)
            if log:
                log(f"  {r.status:<4} {r.name:<13} {r.detail}")
    env = {
        "device": str(setup.device),
        "dtype": str(setup.dtype).replace("torch.", ""),
        "compile": setup.fwd is not unwrap(setup.fwd),
        "torch": torch.__version__,
        "config": resolved(setup.cfg),
        "verify_config": dataclasses.asdict(setup.vcfg),
    }
    return Report(results, subset, env, time.perf_counter() - t0)


def mirror_optimizer(optimizer, model, fresh) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class, groups and hyper-parameters over `fresh`'s
    parameters (matched by name), with no state: the run's exact optimizer recipe, so a
    parameter it leaves out is left out here too."""
    name_of = {id(p): n for n, p in unwrap(model).named_parameters()}
    fresh_params = dict(unwrap(fresh).named_parameters())
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [fresh_params[name_of[id(p)]] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    return type(optimizer)(
        groups,
        **{k: optimizer.defaults[k] for k in ("foreach", "fused") if k in optimizer.defaults},
    )


def run_suite(
    cfg: TrainConfig,
    data_dir,
    subset: str = "fast",
    out_dir=None,
    model_factory: Callable[[TrainConfig], torch.nn.Module] | None = None,
    optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    loader_factory: Callable[[], object] | None = None,
    tokenizer=None,
    vcfg: VerifyConfig | None = None,
    checks: list[str] | None = None,
    log=print,
) -> Report:
    """Build what `fit` would build from `cfg` (`build_parts`: device, dtype, model,
    optimizer, loader, compile) and run the subset (or the named `checks`); write verify.md and
    verify.json to out_dir. The factories let tests plant failures: model_factory(cfg) -> model
    (moved to the device here), optimizer_factory(model), loader_factory()."""
    names = select(subset, checks)
    parts = build_parts(
        cfg,
        data_dir,
        model_factory=model_factory,
        optimizer_factory=optimizer_factory,
        loader_factory=loader_factory,
        log=log,
    )
    setup = Setup.from_parts(
        parts, data_dir, cfg=cfg, tokenizer=tokenizer, vcfg=vcfg or VerifyConfig()
    )
    report = run_checks(setup, names, subset if not checks else "custom")
    if out_dir is not None:
        md, js = report.write(out_dir)
        log(f"wrote {md} and {js}")
    log(report.format())
    return report


def verify_before_training(
    parts: Parts,
    log=print,
    out_dir=None,
    subset: str = "fast",
    vcfg: VerifyConfig | None = None,
    names: list[str] | None = None,
) -> Report:
    """The fast subset (or `names`) on the `Parts` of a run (its own objects), for `fit` before
    step 1: its eager model, what its step calls (compiled when cfg.compile), its optimizer and
    loader. The checks that step or train get fresh copies made like the run's: the same model
    class and config, the same optimizer recipe mirrored group by group (so a parameter the
    run's optimizer misses is missed here too) and the run's loader factory."""
    setup = Setup.from_parts(
        parts,
        parts.loader.data_dir,
        make_model=fresh_like(parts.model, parts.device),
        make_optimizer=lambda m: mirror_optimizer(parts.optimizer, parts.model, m),
        vcfg=vcfg or VerifyConfig(),
    )
    log(f"verifying before step 1 ({subset} subset; --skip-verify skips it)")
    report = run_checks(setup, select(subset, names), subset, log=log)
    return require_pass(
        report, out_dir, log, ". Run `doel-train verify --full` for the whole suite."
    )


def require_pass(report: Report, out_dir, log, advice: str = "") -> Report:
    """What a run does with its checks before step 1 (fit's and sft's alike): log the summary,
    write the report to out_dir if given, and raise VerificationError naming the failed checks,
    after every row was logged, so nothing trains on a failure."""
    log(report.summary())
    if out_dir is not None:
        report.write(out_dir)
    if not report.ok:
        raise VerificationError(
            f"refusing to train: verification failed ({', '.join(report.failed)}); see the rows "
            "above" + (f" and {Path(out_dir) / 'verify.md'}" if out_dir else "") + advice
        )
    return report
