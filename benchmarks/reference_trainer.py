"""The reference trainer on our data: ``speculators train`` against train_drafter, same shards, same vocab.

A finished run's hidden-state shards and draft vocabulary are written out in the layout
speculators 0.9's trainer reads (``--data-path``: an Arrow dataset of ``input_ids``,
``loss_mask``, ``seq_len`` and ``hidden_states/hs_<i>.safetensors`` holding
``hidden_states`` ``[T, A + 1, H]``, the drafter's aux layers then the final one, and
``token_ids``); training's own validation samples come last, so that
``--train-data-ratio`` holds out exactly them. ``speculators train`` then runs with its own
defaults except what makes the comparison fair: the run's epochs, TTT steps, aux layer ids
and d2t/t2d (``--d2t-path``/``--t2d-path``), eager loss when its fused loss fails. Both
drafters are measured by benchmarks/drafter_gap.py's rows (``vllm/default``: vLLM on the
evaluation prompts and on the validation prompts, ``offline/validation``: replay of the
validation answers), which run the evaluation's engine settings.

The run's files each stage reads are checked first (a missing one named with the Snakemake
command that makes it); ``speculators train`` and the rows run as subprocesses in sessions of
their own with their logs under ``--work``; ``--out`` is rewritten after every stage, a failed
stage recorded with its error and log, and the script exits 1 at the end when one failed.

Run after the run itself (``bash envs/gpu-host-setup.sh <wheelhouse>`` on the GPU host;
``benchmarks/drafter_gap_h200.sh`` runs both)::

    .venv/bin/python benchmarks/reference_trainer.py --configfile config/examples/smollm2-h200.yaml \\
        --out benchmarks/results/reference_trainer_h200.json
    (a GPU host: speculators' trainer moves its model to CUDA device 0; ``--stage export``
    alone runs anywhere)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phases  # noqa: E402


def export_for_speculators(shards: list[str], val_fraction: float, aux_layer_ids: list[int] | None, out: Path) -> dict:
    """Write ``shards`` as a ``speculators train --data-path`` directory at ``out`` (replaced).

    Args:
        shards: hidden-state shards (:class:`eagle3_pipeline.shards.ShardReader`).
        val_fraction: ``training.val_fraction``; the samples
            :func:`eagle3_pipeline.training.split_items` holds out are written last.
        aux_layer_ids: ``training.aux_layer_ids`` (``None``: every stored aux layer).
        out: the data directory.

    Returns:
        ``{"samples", "train", "val", "train_data_ratio", "aux_layer_ids", "ids"}``: the ratio
        to pass as ``--train-data-ratio`` (``int(samples * ratio) == train``) and the sample
        ids in file order.

    Each ``hs_<i>.safetensors`` holds the tensors train_drafter's loader reads for sample
    ``i`` (fp8 rows dequantised to bf16): ``hidden_states`` ``[T, A + 1, H]``, ``token_ids``
    int64 ``[T]``; the dataset's ``input_ids``/``loss_mask`` are int64 ``[T]``.
    """
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from eagle3_pipeline.conventions import drafter_aux_columns
    from eagle3_pipeline.shards import ShardReader
    from eagle3_pipeline.training import split_items

    readers = [ShardReader(p) for p in shards]
    aux, columns = drafter_aux_columns(aux_layer_ids, readers[0].aux_layer_ids)
    train, val = split_items(readers, val_fraction)
    shutil.rmtree(out, ignore_errors=True)
    (out / "hidden_states").mkdir(parents=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    ids = []
    for i, (s, j) in enumerate(train + val):
        r = readers[s]
        smp = r.sample(j, layers=[*columns, len(r.layer_ids) - 1])
        tokens = torch.as_tensor(smp["input_ids"]).long()
        save_file(
            {"hidden_states": smp["hidden_states"].contiguous(), "token_ids": tokens},
            str(out / "hidden_states" / f"hs_{i}.safetensors"),
        )
        rows["input_ids"].append(tokens.tolist())
        rows["loss_mask"].append(torch.as_tensor(smp["loss_mask"]).long().tolist())
        rows["seq_len"].append(len(tokens))
        ids.append(smp["id"])
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out))  # speculators reads tensors
    n = len(ids)
    return {
        "samples": n,
        "train": len(train),
        "val": len(val),
        "train_data_ratio": (len(train) + 0.5) / n,
        "aux_layer_ids": aux,
        "ids": ids,
    }


def speculators_command(
    cfg: dict, target: str, data: Path, vocab: Path, aux: list[int], ratio: float, save: Path, eager_loss: bool
) -> list[str]:
    """``speculators train``: its defaults (optimizer, lr, schedule, loss, packing length, drafter
    shape) except the run's epochs, TTT steps and loss decay, aux layer ids and draft vocab."""
    import numpy as np

    t = cfg["training"]
    return [
        sys.executable, "-m", "speculators", "train",
        "--verifier-name-or-path", target, "--data-path", str(data), "--speculator-type", "eagle3",
        "--target-layer-ids", *map(str, aux),
        "--d2t-path", str(vocab / "d2t.npy"), "--t2d-path", str(vocab / "t2d.npy"),
        "--draft-vocab-size", str(int(np.load(vocab / "d2t.npy").shape[0])),
        "--epochs", str(t["epochs"]), "--ttt-steps", str(t["ttt_steps"]), "--ttt-step-loss-decay", str(t["ttt_step_loss_decay"]),
        "--train-data-ratio", repr(ratio), "--on-missing", "raise", "--seed", str(cfg["seed"]),
        "--save-path", str(save / "checkpoints"), "--log-dir", str(save / "logs"),
        *(["--loss-implementation", "eager"] if eager_loss else []),
    ]  # fmt: skip


def train_speculators(
    cfg: dict, target: str, data: Path, vocab: Path, aux: list[int], ratio: float, save: Path, timeout: float | None = None
) -> dict:
    """Run ``speculators train`` (a phase: :func:`phases.run_phase`, stopped after ``timeout`` s); with eager
    loss again when the fused loss fails.

    Returns:
        ``{"drafter", "seconds", "command", "eager_loss", "log"}``: the last epoch's checkpoint
        directory (what vLLM loads), the wall time of the successful attempt.

    Raises:
        phases.PhaseError: both attempts failed, or the first one ran into ``timeout``.
    """
    for eager in (False, True):
        shutil.rmtree(save, ignore_errors=True)
        save.mkdir(parents=True)
        cmd = speculators_command(cfg, target, data, vocab, aux, ratio, save, eager)
        # rich wraps at 80 columns off a terminal: one record per line
        run = phases.run_phase(cmd, save / "train.log", timeout=timeout, env={"COLUMNS": "1000"})
        if run.ok:
            epochs = sorted((int(p.name) for p in (save / "checkpoints").iterdir() if p.name.isdigit()), key=int)
            drafter = save / "checkpoints" / str(epochs[-1])
            return {
                "drafter": str(drafter),
                "seconds": round(run.seconds, 1),
                "command": " ".join(cmd),
                "eager_loss": eager,
                "log": str(run.log),
            }
        print(f"speculators train failed (eager loss: {eager}): {run.error}", file=sys.stderr, flush=True)
        if run.timed_out:
            break
    raise phases.PhaseError(f"speculators train failed (eager loss: {eager}): {run.error}", run.log)


def gap_rows(
    configfiles: list[str], overrides: list[str], drafter: str, prompts: int, work: Path, deadline: float | None
) -> tuple[dict, phases.PhaseRun]:
    """drafter_gap.py's ``vllm/default`` and ``offline/validation`` rows for ``drafter`` (its log ``<work>/gap.log``).

    Returns:
        the rows it wrote (failed ones with their ``error``) and how it ended.
    """
    out = work / "gap.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "drafter_gap.py"), "--configfile", *configfiles, "--drafter", drafter]
    cmd += ["--prompts", str(prompts), "--rows", "vllm/default", "offline/validation", "--work", str(work), "--out", str(out)]
    cmd += [*(["--config", *overrides] if overrides else []), *(["--deadline", str(deadline)] if deadline else [])]
    # drafter_gap stops its rows at the deadline itself; the margin covers its start and the last row's cleanup
    run = phases.run_phase(cmd, work / "gap.log", timeout=deadline + 2 * phases.GRACE_SECONDS + 60 if deadline else None)
    rows = json.loads(out.read_text())["rows"] if out.exists() else {}
    return {name: {k: v for k, v in row.items() if k != "settings"} for name, row in rows.items()}, run


def input_problems(cfg: dict, configfiles: list[str], stage: str) -> list[str]:
    """What ``stage`` needs and the run lacks: packages, a GPU for training, the run's shards and draft
    vocab, and for the rows the files drafter_gap.py reads (:func:`drafter_gap.input_problems`)."""
    from drafter_gap import input_problems as rows_problems

    from eagle3_pipeline.layout import RunLayout, shard_ids

    layout = RunLayout(cfg["run"])
    shards = [layout.hidden_states(s) for s in shard_ids(cfg["prompts"]["num_shards"])]
    vocab = [layout.vocab("d2t"), layout.vocab("t2d")]
    out = phases.missing_packages(["datasets", "speculators", *(["vllm"] if stage in ("rows", "all") else [])])
    out += phases.no_cuda() if stage in ("train", "all") else []
    if stage in ("rows", "all"):
        return out + rows_problems(cfg, configfiles, str((ROOT / layout.drafter()).resolve()), vocab)
    return out + phases.missing_run_outputs([*shards, *vocab], configfiles)


def main() -> None:
    from drafter_gap import load_config, target_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", nargs="+", default=[str(ROOT / "config" / "config.yaml")])
    ap.add_argument("--config", nargs="*", default=[], help="YAML snippets applied last")
    ap.add_argument(
        "--stage",
        choices=["export", "train", "rows", "all"],
        default="all",
        help="rows: only the vLLM/offline rows, for the drafter a --stage train run recorded in --out",
    )
    ap.add_argument("--ours-rows", help="a drafter_gap.py --out JSON of the run's own drafter: its rows instead of measuring again")
    ap.add_argument("--prompts", type=int, default=200, help="validation prompts for the vLLM rows")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "reference_trainer"))
    ap.add_argument("--deadline", type=float, help="seconds for each drafter's rows (a leased GPU)")
    ap.add_argument("--timeout", type=float, help="seconds before speculators train is stopped with its processes")
    ap.add_argument("--out")
    args = ap.parse_args()
    phases.fail_fast(phases.missing_packages(["snakemake"]))  # load_config merges as Snakemake does
    cfg = load_config(args.configfile, args.config)
    run = ROOT / "results" / cfg["run"]
    target = target_dir(cfg)
    work = Path(args.work)
    problems = input_problems(cfg, args.configfile, args.stage)
    if args.stage == "rows" and not (args.out and Path(args.out).exists()):
        problems.append("--stage rows reads the speculators drafter from --out, written by --stage train")
    if args.ours_rows and not Path(args.ours_rows).is_file():
        problems.append(f"--ours-rows {args.ours_rows} does not exist: give drafter_gap.py's --out of the run's drafter, or leave it out")
    phases.fail_fast(problems)
    shards = [str(p) for p in sorted((run / "hidden_states").glob("shard-?????.safetensors"))]
    results = phases.Results(args.out, {"run": cfg["run"], "command": " ".join(["python", *sys.argv]), "config": cfg})

    if args.stage == "rows":  # the drafter a --stage train run recorded
        before = json.loads(Path(args.out).read_text())
        results.data |= {k: v for k, v in before.items() if k in ("command", "export", "ours", "speculators")}
        results.data["rows_command"] = " ".join(["python", *sys.argv])
        if "drafter" not in results.data.get("speculators", {}):
            sys.exit(f"{args.out} holds no speculators drafter: its --stage train failed ({results.data.get('speculators')})")
    else:

        def export() -> dict:
            t = time.perf_counter()
            e = export_for_speculators(shards, cfg["training"]["val_fraction"], cfg["training"]["aux_layer_ids"], work / "data")
            return {k: v for k, v in e.items() if k != "ids"} | {"seconds": round(time.perf_counter() - t, 1)}

        exported = results.inline("export", export, section=None)
        if exported is None:
            sys.exit(results.finish())
        print(f"exported {exported['samples']} samples to {work / 'data'}", flush=True)
        if args.stage == "export":
            sys.exit(results.finish())
        ours_summary = run / "train" / "summary.json"
        ours = {"drafter": str((run / "drafter").resolve())}
        if ours_summary.exists():
            s = json.loads(ours_summary.read_text())
            ours |= {k: s.get(k) for k in ("seconds", "total_seconds", "steps", "tokens_seen")}
        results.put("ours", ours, None)
        trained = results.inline(
            "speculators",
            train_speculators,
            cfg,
            target,
            work / "data",
            run / "vocab",
            exported["aux_layer_ids"],
            exported["train_data_ratio"],
            work / "speculators",
            args.timeout,
            section=None,
        )
        if trained is None or args.stage == "train":
            sys.exit(results.finish())
    result = results.data
    if args.ours_rows:  # the same rows, measured by drafter_gap.py on the same drafter
        rows = json.loads(Path(args.ours_rows).read_text())["rows"]
        result["ours"]["rows"] = {n: {k: v for k, v in r.items() if k != "settings"} for n, r in rows.items()}
        result["ours"]["rows_from"] = args.ours_rows
    for name in [n for n in ("ours", "speculators") if "rows" not in result[n]]:
        rows, gap = gap_rows(args.configfile, args.config, result[name]["drafter"], args.prompts, work / f"gap-{name}", args.deadline)
        result[name]["rows"] = rows
        results.record("gap_rows", gap, {"command": "drafter_gap.py --drafter " + result[name]["drafter"]}, section=name)
    table = [
        (name, row, result[name]["rows"].get(row, {}).get("tau") or result[name]["rows"].get(row, {}).get("acceptance_length"))
        for name in ("ours", "speculators")
        for row in ("vllm/default/eval", "vllm/default/validation-short", "offline/validation")
    ]
    result["table"] = [{"trainer": n, "row": r, "tau": v} for n, r, v in table]
    for n, r, v in table:
        print(f"{n:12s} {r:32s} tau {v}")
    sys.exit(results.finish())


if __name__ == "__main__":
    main()
