"""What the three suites of ``docs/claims-2.md`` share: seeds, instruments, run specs, the
base gate, the printed verdicts and the output record.

Every run of part 2 has its instruments on (``logging.update_stats=true``; in the paper
environment the call probe after every step, ``--call-probe-every 1 --call-probe-n 16``), is
seeded with no staleness (part 1's plan) and is made by :func:`.runs.run_all`, which reuses a
finished run with the same inputs. A suite's default seeds are the held-out ones
(:data:`.claims2.HELDOUT_SEEDS`); ``--seeds`` overrides them, and the printed label says
which set ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_tg.demo import claims2 as K

ROOT = K.ROOT
INSTRUMENTS = ("logging.update_stats=true",)
"""Overrides every run of part 2 gets (the per-step update statistics)."""
PAPER_RL_ARGS = ("--env", "paper", "--call-probe-every", "1", "--call-probe-n", "16")
"""The paper environment with its call probe at step 0 and after every step."""
BASE_REFUSED = 3
"""Exit status when a held-out call finds its base outside the pre-registered range."""


def plan(steps: int, seeds: Sequence[int], rl_args: Sequence[str]):
    from megatron_tg.demo.runs import Plan

    return Plan(steps=steps, seeds=tuple(seeds), last=K.LAST, variants=(), probe_every=0,
                heldout=0, seeded=True, rl_args=tuple(rl_args))


def run_specs(runs: Sequence[tuple[str, str, tuple[str, ...]]], seeds: Sequence[int]):
    """(arm, objective.mode, overrides) x seeds -> RunSpecs named ``<arm>-s<seed>``, the
    instruments on."""
    from megatron_tg.demo.runs import RunSpec

    return [RunSpec(f"{arm}-s{s}", mode, s, extra=(*extra, *INSTRUMENTS)) for s in seeds for arm, mode, extra in runs]


def recipe_for(a, default: Path) -> Path:
    """The demo's default recipe means "this suite's default"; any other is used as given."""
    from megatron_tg.demo.runs import RECIPE as MAIN_RECIPE

    return default if Path(a.recipe).resolve() == MAIN_RECIPE.resolve() else Path(a.recipe).resolve()


FIX_REFUSED = 2
"""Exit status of a call on the fix seeds that may not run there."""
BASE_UNRECORDED = 4
"""Exit status when a base's build hash is not recorded (committed) in ``docs/results/``."""
RESULTS = "docs/results"


def refuse_fix_seeds(a, log, allowed: bool = False) -> int | None:
    """The fix seeds validate the fix (experiment D's ``tg_fix``, on exactly those seeds):
    any other use of them is refused with :data:`FIX_REFUSED`, else None."""
    if a.seeds and set(a.seeds) & set(K.FIX_SEEDS) and not (allowed and tuple(a.seeds) == K.FIX_SEEDS):
        log(f"seeds {','.join(map(str, K.FIX_SEEDS))} are kept for validating the fix (--suite dip "
            f"--seeds {','.join(map(str, K.FIX_SEEDS))}, after its held-out call): not run")
        return FIX_REFUSED
    return None


def base_record_path(suite: str, root: Path | None = None) -> Path:
    return Path(root or ROOT) / RESULTS / f"claims2-{suite}-base.json"


def environment() -> dict[str, str]:
    """The library versions a base's build hash covers besides its settings and the package's
    source (:func:`.base_model.build_hash`): under other versions the hash differs, so a
    record names the ones it was built under (which base a build made is its weights digest's
    to say: the same settings train other weights on another CPU)."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def write_base_record(suite: str, bases: Mapping[str, Mapping[str, Any]], log, root: Path | None = None) -> Path:
    """The build-only step's output: each base's build hash and measured metrics, written to
    ``docs/results/claims2-<suite>-base.json`` to be committed before any RL run from them."""
    from megatron_tg.demo.runs import _write_atomic

    path = base_record_path(suite, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"suite": suite, "environment": environment(),
           "bases": {k: {x: v for x, v in b.items() if isinstance(v, (int, float, str))
                         and x != "cached"} for k, b in bases.items()}}
    _write_atomic(path, json.dumps(rec, indent=2, sort_keys=True, default=float) + "\n")
    hashes = ", ".join(f"{k} {b['build_hash'][:16]}" for k, b in bases.items())
    log(f"base record -> {path}: commit it before any RL run from these bases ({hashes})")
    return path


def recorded(build_hash: str, root: Path | None = None) -> bool | None:
    """Whether the hash (or any string: a weights digest) is in a file under
    ``docs/results/`` as committed at HEAD (None without git)."""
    import subprocess

    try:
        r = subprocess.run(["git", "-C", str(root or ROOT), "grep", "-q", "-F", build_hash, "HEAD", "--", RESULTS],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return True if r.returncode == 0 else False if r.returncode == 1 else None


def _unrecorded(k: str, b: Mapping[str, Any], root: Path | None) -> str | None:
    """Why base ``k`` is not the committed one, or None. A base is its weights: one whose
    weights digest is committed is the recorded base, whatever its build hash (an edit of
    the base modules that changes no computation changes the hash, not the weights); one
    whose digest is not committed is another base, even where the hash is (same inputs,
    other weights: another CPU)."""
    w = b.get("weights_sha256")
    if w is not None and recorded(f'"weights_sha256": "{w}"', root) is True:
        return None
    if recorded(b["build_hash"], root) is not True:
        return f"{k}: build hash {b['build_hash'][:16]} not committed (weights {w})"
    return (f"{k}: build hash {b['build_hash'][:16]} committed, but not these weights ({w}): the same settings "
            f"trained other weights here (base builds are not bit-reproducible across CPUs), so this is not "
            f"the recorded base; rebuild its record on this machine as an amendment")


def bases_recorded(bases: Mapping[str, Mapping[str, Any]], log, enforce: bool = True,
                   root: Path | None = None) -> bool:
    """The rule that bases are fixed before any RL run on them, development runs included:
    False (refuse) when a base is not the committed one (:func:`_unrecorded`: its weights
    digest not under ``docs/results/``); ``enforce`` False (tests' tiny bases only) turns the
    refusal into a warning."""
    missing = [m for m in (_unrecorded(k, b, root) for k, b in bases.items()) if m]
    if not missing:
        log("bases recorded in " + RESULTS + ": " + ", ".join(f"{k} {b['build_hash'][:16]} (weights "
                                                          f"{b.get('weights_sha256')})" for k, b in bases.items()))
        return True
    env = ", ".join(f"{k} {v}" for k, v in environment().items())
    what = (f"base not committed under {RESULTS}: {'; '.join(missing)}. The hash covers the settings, the base "
            f"modules' source and the library versions (here {env}; a committed record names the ones it was "
            f"built under: install those); or run the suite with --build-only, commit its record, then run")
    if enforce:
        log(f"REFUSED: {what}; no RL run is made")
        return False
    log(f"WARNING: {what} (not enforced: a test's base)")
    return True


def start(a, log, suite: str) -> dict[str, Any]:
    """Seeds, steps, their label and the provenance, logged before anything runs."""
    seeds = tuple(a.seeds) if a.seeds else K.HELDOUT_SEEDS
    steps = a.steps or K.STEPS
    kind = K.seed_set(seeds, steps, K.FIX_SEEDS if seeds == K.FIX_SEEDS else K.HELDOUT_SEEDS)
    prov = K.provenance()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log(f"suite {suite}: seeds {','.join(map(str, seeds))}, {steps} steps: {kind}")
    for line in K.provenance_lines(prov):
        log(line)
    return {"seeds": seeds, "steps": steps, "kind": kind, "provenance": prov, "out": out}


def base_gate(ctx: Mapping[str, Any], ok: bool, what: str, log) -> bool:
    """False when the held-out report must not run on this base (the document's rule: the base
    is rebuilt, as an amendment, before any RL run on it); elsewhere a warning."""
    if ok:
        log(f"base check passes: {what}")
        return True
    if ctx["kind"].startswith("held-out"):
        log(f"BASE OUTSIDE THE PRE-REGISTERED RANGE: {what}; no RL run is made (rebuild the base "
            f"and record the change under Amendments in {K.CLAIMS2_DOC})")
        return False
    log(f"WARNING: base outside the pre-registered range: {what} (not a held-out call: the runs go on)")
    return True


def measures(dirs: Mapping[str, Sequence[Path]], criteria: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    from megatron_tg.train.metrics import read_metrics

    return {arm: [K.measure(read_metrics(d), criteria) for d in ds] for arm, ds in dirs.items()}


def _f(x: Any, fmt: str = "+.3f") -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def seed_table(m: Mapping[str, Sequence[Mapping[str, Any]]], seeds: Sequence[int],
               style: Sequence[str] = ()) -> str:
    """Per arm and seed: start (pass_1), dip, t*, worst, final pass, learned, pass onset s_p,
    and the probe's close fall, close onset s_c and branch rise (versions)."""
    lines = [f"{'run':<16} {'seed':>4} {'start':>6} {'dip':>7} {'t*':>3} {'worst':>6} {'final':>6} "
             f"{'learned':>7} {'s_p':>3} {'close fall':>10} {'s_c':>3} {'branch rise':>11}"]
    for arm, xs in m.items():
        for s, x in zip(seeds, xs):
            lrn = _f(K.learned(x, style), ".0f") if style else "-"
            lines.append(f"{arm:<16} {s:>4} {_f(x['start'], '.3f'):>6} {_f(x['dip']):>7} "
                         f"{_f(x['dip_step'], 'd'):>3} {_f(x['worst'], '.3f'):>6} {_f(x['pass'], '.3f'):>6} "
                         f"{lrn:>7} {_f(x['pass_onset'], 'd'):>3} {_f(x['close_fall']):>10} "
                         f"{_f(x['close_onset'], 'd'):>3} {_f(x['branch_rise']):>11}")
    starts = {s: {x["start"] for x in (xs[i] for xs in m.values())} for i, s in enumerate(seeds)}
    differ = [str(s) for s, v in starts.items() if len(v) > 1]
    lines.append("start (pass_1) shared by each seed's arms: " + (
        "yes" if not differ else f"NO on seeds {','.join(differ)} (each arm's own pass_1 is its start)"))
    return "\n".join(lines)


def verdict_lines(c: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each claim / hypothesis / level: its verdict, then each test's estimate, interval, rule
    and whether it passes (reported tests and tests that decide nothing are marked so)."""
    out = []
    for k, v in c.items():
        out.append(f"{k:<16} {v['verdict']}")
        for name, t in v["tests"].items():
            lo, hi = t["interval"]
            res = t["status"]
            tag = "" if name in v["decides"] or res == "reported" else "  [reported, decides nothing]"
            out.append(f"    {name:<22} {_f(t['estimate'])} [{_f(lo)}, {_f(hi)}]  rule {t['rule']}: "
                       f"{res}  ({t['what']}){tag}")
    return out


def amendment(first: Mapping[str, Any] | None, now: Mapping[str, Any]) -> dict[str, Any] | None:
    """Against the first held-out record of an output directory: the rule files changed since,
    and its verdicts (None when nothing changed or there is no first record)."""
    if not first:
        return None
    a, b = first["provenance"]["files"], now["files"]
    changed = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
    if not changed:
        return None
    return {"changed_after_heldout": changed, "first_head": first["provenance"].get("head"),
            "first_verdicts": {k: v["verdict"] for k, v in first["verdicts"].items()}}


FIRST = {False: "heldout_first.json", True: "fix_first.json"}
"""The first verdicts of a held-out call and of the fix's call (first write wins)."""


def finish(ctx: Mapping[str, Any], name: str, verdicts: Mapping[str, Mapping[str, Any]],
           extra: Mapping[str, Any], table: str, wall: float, footer: Sequence[str] = ()) -> int:
    """Write ``OUT/<name>.json`` (and, on a held-out call, the first held-out record), print
    the table, the label, the provenance, the verdicts and ``footer``; 0."""
    from megatron_tg.demo.runs import _write_atomic

    out, prov = ctx["out"], ctx["provenance"]
    record = {"suite": name, "seeds": list(ctx["seeds"]), "steps": ctx["steps"], "seed_set": ctx["kind"],
              "provenance": prov, "verdicts": verdicts}
    amended = None
    if ctx["kind"].startswith(("held-out", "fix seeds")):
        first_path = out / FIRST[ctx["kind"].startswith("fix seeds")]
        try:
            first = json.loads(first_path.read_text())
        except (OSError, ValueError):
            first = None
            _write_atomic(first_path, json.dumps(record, indent=2, default=float) + "\n")
        amended = amendment(first, prov)
    _write_atomic(out / f"{name}.json", json.dumps({
        **record, "wall_seconds": round(wall, 1), "amended_after_heldout": amended,
        "intervals": {"kind": "Student-t over seeds, df = seeds - 1", "confidence": K.CONFIDENCE,
                      "hypothesis_confidence": K.HYPOTHESIS_CONFIDENCE},
        **extra}, indent=2, default=float) + "\n")
    print()
    print(table)
    print()
    print(f"seeds {','.join(map(str, ctx['seeds']))}, {ctx['steps']} steps: {ctx['kind']}; interval: "
          f"Student-t intervals over seeds (df = seeds - 1), {K.CONFIDENCE:.0%}; "
          f"{K.HYPOTHESIS_CONFIDENCE:.1%} for the tests that decide H1-H3")
    for line in K.provenance_lines(prov):
        print(line)
    if amended:
        print(f"RULES CHANGED after the first held-out verdicts in {out}: "
              f"{', '.join(amended['changed_after_heldout'])} (first verdicts: {json.dumps(amended['first_verdicts'])})")
    for line in [*verdict_lines(verdicts), *footer]:
        print(line)
    print(f"\nwall {wall:.0f} s; {out / (name + '.json')}")
    return 0
