"""The run's figures (eagle3_pipeline.report) and `snakemake --report` opened in a real headless browser.

Unit tests check each figure's data against values computed here independently; the browser
test (markers e2e, browser) builds the report of the session's end-to-end run (e2e_run) and
opens it in headless chromium. Without chromium the browser test is skipped, except under
CI=true, where it fails (.ci/run installs chromium-headless-shell).
"""

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from e2e_support import snakemake_cli
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from eagle3_pipeline.report import (
    FIGURES,
    acceptance_figure,
    accuracy_figure,
    coverage_curve,
    coverage_figure,
    estimate_figure,
    generation_figure,
    length_bins,
    lengths_figure,
    loss_figure,
    make_plots,
    positions,
    read_metrics,
    read_trace_lengths,
    reject_counts,
    rejects_figure,
    speedup_figure,
    throughput_figure,
)
from eagle3_pipeline.vocab import coverage_ladder

ROOT = Path(__file__).resolve().parents[1]


def _bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


# --- data behind the figures -------------------------------------------------------------------


def test_coverage_curve_of_a_small_count_table():
    # ids 0..5; supervised counts: id 3 most frequent, ids 1 and 5 tie, id 4 never occurs
    counts = np.array([1, 2, 0, 4, 0, 2], dtype=np.int64)
    cov = coverage_curve(counts)
    # by hand: sorted 4, 2, 2, 1, 0, 0 of 9
    assert cov == pytest.approx([4 / 9, 6 / 9, 8 / 9, 1.0, 1.0, 1.0])
    # the same numbers as coverage.json's ladder (vocab.coverage_ladder) at every size
    ladder = coverage_ladder(counts, range(1, 7))
    assert [ladder[n] for n in range(1, 7)] == pytest.approx(cov.tolist())
    assert coverage_curve(np.zeros(4, dtype=np.int64)).tolist() == [0.0] * 4


def test_coverage_figure_plots_the_curve_and_marks_the_chosen_size():
    counts = np.array([1, 2, 0, 4, 0, 2, 0, 0], dtype=np.int64)
    coverage = {"draft_vocab_size": 2, "coverage": 6 / 9, "distinct_supervised_tokens": 4}
    ax = coverage_figure(counts, coverage).axes[0]
    curve, chosen_line, chosen_point, distinct_line = ax.lines
    assert curve.get_xdata().tolist() == list(range(1, 9))
    assert curve.get_ydata() == pytest.approx([4 / 9, 6 / 9, 8 / 9, 1, 1, 1, 1, 1])
    assert list(chosen_line.get_xdata()) == [2, 2] and "chosen size 2" in chosen_line.get_label()
    assert (list(chosen_point.get_xdata()), list(chosen_point.get_ydata())) == ([2], [pytest.approx(6 / 9)])
    assert "66.67%" in chosen_point.get_label()
    assert list(distinct_line.get_xdata()) == [4, 4]
    assert ax.get_xscale() == "log"


def test_trace_lengths_and_their_histogram(tmp_path):
    recs = [
        {"prompt_token_ids": list(range(p)), "completion_token_ids": list(range(c))}
        for p, c in ((7, 3), (9, 40), (30, 40), (8, 12), (7, 0))
    ]
    a, b = tmp_path / "shard-00000.jsonl", tmp_path / "shard-00001.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in recs[:3]))
    b.write_text("".join(json.dumps(r) + "\n" for r in recs[3:]))
    prompt, completion = read_trace_lengths([a, b])
    assert prompt.tolist() == [7, 9, 30, 8, 7] and completion.tolist() == [3, 40, 40, 12, 0]
    # whole-token bins from the shortest to one past the longest
    assert length_bins(prompt, max_bins=40).tolist() == list(range(7, 32))
    assert length_bins(completion, max_bins=10).tolist() == [0, 5, 10, 15, 20, 25, 30, 35, 40, 45]
    fig = lengths_figure(prompt, completion, max_tokens=40, bins=10)
    p_ax, c_ax = fig.axes
    # prompt bins of 3 tokens from 7: [7,10) holds 7, 9, 8, 7; [28,31) holds 30
    assert _bar_heights(p_ax) == [4, 0, 0, 0, 0, 0, 0, 1]
    # completion bins of 5 from 0: [0,5) 0 and 3, [10,15) 12, [40,45) 40 twice
    assert _bar_heights(c_ax) == [2, 0, 1, 0, 0, 0, 0, 0, 2]
    assert list(c_ax.lines[0].get_xdata()) == [40, 40] and c_ax.lines[0].get_label() == "max_tokens = 40"
    assert "n=5, median 8, mean 12.2" in p_ax.get_title()


SUMMARY = {
    "prompts": {"read": 30, "kept": 12, "rejected": 18, "rejects_by_reason": {"duplicate": 3, "over_max_prompts": 15}},
    "generation": {
        "prompts": 12,
        "ok": 10,
        "errored": 1,
        "truncated": 4,
        "repetition_loops": 2,
        "rejected": 1,
        "rejects_by_reason": {"prompt_too_long": 1},
        "reasoning_captured": 5,
        "reasoning_capture_rate": 0.5,
    },
    "rejects": {"prompts": 18, "generation": 1, "total": 19},
    "throughput": {
        "train_drafter": {"tokens_per_second": 600.0, "load_seconds": 0.0, "source": "measured"},
        "generate_traces": {"tokens_per_second": 400.0, "load_seconds": 24.0, "source": "measured"},
    },
    "estimate_vs_actual": [
        {"stage": "generate_traces", "estimated_seconds": 100.0, "actual_seconds": 120.0, "actual_over_estimate": 1.2, "source": "x"},
        {"stage": "train_drafter", "estimated_seconds": 50.0, "actual_seconds": None, "actual_over_estimate": None, "source": "x"},
    ],
}


def test_generation_outcomes_and_reasoning_capture_rate():
    ax = generation_figure(SUMMARY).axes[0]
    labels = ["prompts", "ok", "truncated", "looping", "with reasoning", "errored", "rejected"]
    assert [t.get_text() for t in ax.get_xticklabels()] == labels
    assert _bar_heights(ax) == [12, 10, 4, 2, 5, 1, 1]
    assert "reasoning capture rate 50.0%" in ax.get_title()


def test_rejects_by_stage_and_reason_largest_first():
    # prompts beyond max_prompts are not rejects: no bar, apart in the title
    assert reject_counts(SUMMARY) == {
        "prompts: duplicate": 3,
        "generation: errored": 1,
        "generation: prompt_too_long": 1,
    }
    ax = rejects_figure(SUMMARY).axes[0]
    # horizontal bars bottom-up: the largest on top
    assert [t.get_text() for t in ax.get_yticklabels()] == ["generation: prompt_too_long", "generation: errored", "prompts: duplicate"]
    assert [p.get_width() for p in ax.patches] == [1, 1, 3]
    assert ax.get_title() == ("rejected or errored records: 5\n3 prompts, 2 in generation\n15 prompts beyond max_prompts, not used")
    # the demo: 15,320 beyond max_prompts and nothing else is no reject at all
    demo = {**SUMMARY, "prompts": {**SUMMARY["prompts"], "rejects_by_reason": {"over_max_prompts": 15_320}}}
    demo["generation"] = {**SUMMARY["generation"], "errored": 0, "rejects_by_reason": {}}
    ax = rejects_figure(demo).axes[0]
    assert ax.get_title() == "rejected or errored records: 0\n0 prompts, 0 in generation\n15,320 prompts beyond max_prompts, not used"
    assert "no record was rejected" in ax.texts[0].get_text() and not ax.patches
    empty = {**demo, "prompts": {**SUMMARY["prompts"], "rejects_by_reason": {}}}
    assert rejects_figure(empty).axes[0].get_title() == "rejected or errored records: 0\n0 prompts, 0 in generation"


def _metrics(tmp_path) -> Path:
    rows = [
        {
            "split": "train",
            "step": 2,
            "loss": 9.0,
            "loss_0": 4.0,
            "loss_1": 5.0,
            "full_acc_0": 0.2,
            "full_acc_1": 0.1,
            "cond_acc_0": 0.2,
            "cond_acc_1": 0.5,
        },
        {
            "split": "train",
            "step": 1,
            "loss": 10.0,
            "loss_0": 4.5,
            "loss_1": 5.5,
            "full_acc_0": 0.1,
            "full_acc_1": 0.0,
            "cond_acc_0": 0.1,
            "cond_acc_1": 0.0,
        },
        {
            "split": "val",
            "step": 2,
            "loss": 9.5,
            "loss_0": 4.2,
            "loss_1": 5.3,
            "full_acc_0": 0.15,
            "full_acc_1": 0.05,
            "cond_acc_0": 0.15,
            "cond_acc_1": 0.33,
        },
    ]
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_training_loss_and_per_position_accuracy_curves(tmp_path):
    m = read_metrics(_metrics(tmp_path))
    assert [r["step"] for r in m["train"]] == [1, 2] and [r["step"] for r in m["val"]] == [2]
    assert positions(m) == [0, 1]
    total, per_position = loss_figure(m).axes
    train, val = total.lines
    assert (list(train.get_xdata()), list(train.get_ydata())) == ([1, 2], [10.0, 9.0])
    assert (list(val.get_xdata()), list(val.get_ydata())) == ([2], [9.5])
    # per position: a train line and a validation point each, position 0 then 1
    assert [list(line.get_ydata()) for line in per_position.lines] == [[4.5, 4.0], [4.2], [5.5, 5.0], [5.3]]
    full, cond = accuracy_figure(m).axes
    assert [list(line.get_ydata()) for line in full.lines] == [[0.1, 0.2], [0.15], [0.0, 0.1], [0.05]]
    assert [list(line.get_ydata()) for line in cond.lines] == [[0.1, 0.2], [0.15], [0.0, 0.5], [0.33]]
    assert [line.get_label() for line in full.lines[::2]] == ["position 0", "position 1"]


def test_acceptance_overall_and_per_position():
    acc = {
        "acceptance_length": 1.5,
        "num_speculative_tokens": 3,
        "per_position_acceptance_rate": [0.3, 0.15, 0.05],
        "num_prompts": 4,
        "num_drafts": 100,
        "offline_validation": {"full_acc_0": 0.35, "full_acc_1": 0.2, "full_acc_2": 0.1},
    }
    left, right = acceptance_figure(acc).axes
    assert _bar_heights(left) == [1.5]
    assert [list(line.get_ydata()) for line in left.lines] == [[4, 4], [1, 1]]  # ceiling 1 + k, and 1
    assert _bar_heights(right) == [0.3, 0.15, 0.05]
    assert list(right.lines[0].get_ydata()) == [0.35, 0.2, 0.1]
    assert "4 prompts, 100 drafts of k = 3" in right.get_title()
    # no speedup measured: the figure says so
    assert "no speedup measured" in speedup_figure(acc).axes[0].texts[0].get_text()
    acc["speedup"] = [
        {
            "concurrency": 1,
            "requests": 4,
            "with_drafter_tokens_per_second": 30.0,
            "without_drafter_tokens_per_second": 20.0,
            "speedup": 1.5,
        },
        {
            "concurrency": 16,
            "requests": 4,
            "with_drafter_tokens_per_second": 200.0,
            "without_drafter_tokens_per_second": 250.0,
            "speedup": 0.8,
        },
    ]
    ax = speedup_figure(acc).axes[0]
    assert _bar_heights(ax) == [20.0, 250.0, 30.0, 200.0]  # target alone at 1 and 16, then with the drafter
    assert [t.get_text() for t in ax.texts] == ["1.50x", "0.80x"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 in flight\n(4 requests)", "16 in flight\n(4 requests)"]
    # with the validation answers replayed as vLLM decodes them: their τ on the left, rates on the right
    acc["offline_validation"] |= {"replay_tau": 1.4, "replay_acc_0": 0.25, "replay_acc_1": 0.1, "replay_acc_2": 0.05}
    left, right = acceptance_figure(acc).axes
    assert list(left.lines[-1].get_ydata()) == [1.4]
    assert [list(line.get_ydata()) for line in right.lines] == [[0.35, 0.2, 0.1], [0.25, 0.1, 0.05]]
    # the markers beside each bar's centre and τ's value inside its bar: no value label under a marker
    assert [list(line.get_xdata()) for line in right.lines] == [[-0.25, 0.75, 1.75], [0.25, 1.25, 2.25]]
    (label,) = left.texts
    assert label.get_text() == "1.500" and label.xy == (
        0.5,
        0.5,
    )  # the middle of the bar (matplotlib places it in the bar's own coordinates)


def test_throughput_and_estimate_vs_actual_from_the_summary():
    ax = throughput_figure(SUMMARY).axes[0]
    # pipeline order top-down (horizontal bars are drawn bottom-up)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["train_drafter", "generate_traces"]
    assert [p.get_width() for p in ax.patches] == [600.0, 400.0]
    assert "400 tok/s, load 24 s" in [t.get_text() for t in ax.texts]
    ax = estimate_figure(SUMMARY).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["generate_traces", "train_drafter"]
    heights = _bar_heights(ax)
    assert heights[:2] == [100.0, 50.0] and heights[2] == 120.0 and np.isnan(heights[3])
    assert "1.20x" in [t.get_text() for t in ax.texts]
    none = estimate_figure({**SUMMARY, "estimate_vs_actual": []}).axes[0]
    assert "no start plan had a pending stage" in none.texts[0].get_text()


def test_make_plots_writes_every_figure_as_a_png_with_content(tmp_path):
    traces = tmp_path / "shard-00000.jsonl"
    traces.write_text(
        "".join(json.dumps({"prompt_token_ids": [1] * p, "completion_token_ids": [2] * c}) + "\n" for p, c in ((9, 4), (12, 8)))
    )
    counts = np.array([5, 0, 3, 2], dtype=np.int64)
    np.save(tmp_path / "token_freq.npy", counts)
    (tmp_path / "coverage.json").write_text(json.dumps({"draft_vocab_size": 2, "coverage": 0.8, "distinct_supervised_tokens": 3}))
    acc = {
        "acceptance_length": 1.2,
        "num_speculative_tokens": 2,
        "per_position_acceptance_rate": [0.15, 0.05],
        "num_prompts": 2,
        "num_drafts": 9,
    }
    (tmp_path / "acceptance.json").write_text(json.dumps(acc))
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    out = {name: tmp_path / "plots" / f"{name}.png" for name in FIGURES}
    make_plots(
        [traces],
        tmp_path / "token_freq.npy",
        tmp_path / "coverage.json",
        _metrics(tmp_path),
        tmp_path / "acceptance.json",
        tmp_path / "summary.json",
        out,
        max_tokens=8,
    )
    for name, path in out.items():
        img = imread(path)
        assert img.shape[0] > 200 and img.shape[1] > 500, name
        assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 20, name  # drawn, not a blank canvas
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(f"{n}.png" for n in FIGURES)  # no temporary left


# --- the report in a browser -----------------------------------------------------------------------

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
#: the figure each category holds (rules/plot_run.smk)
CATEGORIES = {
    "lengths": "1. Traces",
    "generation": "1. Traces",
    "rejects": "1. Traces",
    "vocab_coverage": "2. Draft vocabulary",
    "training_loss": "3. Training",
    "training_accuracy": "3. Training",
    "acceptance": "4. Evaluation",
    "speedup": "4. Evaluation",
    "throughput": "5. Run time",
    "estimate_vs_actual": "5. Run time",
}


def _browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    reason = "no headless chromium to open the report in (apt-get install chromium-headless-shell)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"the report's browser test must run in CI, but: {reason}")
    pytest.skip(reason)


def _chromium(browser: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp / 'profile'}",
            "--virtual-time-budget=60000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.e2e
@pytest.mark.browser
def test_report_renders_every_figure_in_a_headless_browser(e2e_run, tmp_path):
    browser = _browser()
    wd, cfg, res = e2e_run
    report = wd / "report.html"
    r = snakemake_cli(wd, cfg, "--report", str(report), timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    text = report.read_text()
    # self-contained: scripts, styles and figures are inside the file, nothing is fetched
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"(https?:)?//", text)
    results = json.loads(re.search(r'<script id="results">\s*var results = (.*?);\s*</script>', text, re.S).group(1))
    plots = {f"results/e2e/plots/{name}.png": name for name in FIGURES}
    assert set(results) == set(plots)
    for path, entry in results.items():
        assert entry["mime_type"] == "image/png" and re.match(r"data:image/png;.*base64,", entry["data_uri"])
        assert len(re.sub("<[^>]+>", "", entry["caption"])) > 100, path  # the caption, rendered
    # captions are filled in from the run's config
    assert "vocab.draft_vocab_size</tt> = 2048" in results["results/e2e/plots/vocab_coverage.png"]["caption"]
    assert "= 40" in results["results/e2e/plots/lengths.png"]["caption"]  # generation.max_tokens

    # the report with tests/report_render_check.js appended: it clicks through the app and measures each image
    page = tmp_path / "report-check.html"
    cut = text.rindex("</body>")
    page.write_text(text[:cut] + "<script>" + (ROOT / "tests" / "report_render_check.js").read_text() + "</script>" + text[cut:])
    url = page.as_uri() + "#show=vocab_coverage.png"
    dom = _chromium(browser, tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-3000:]
    found = re.search(r'<pre id="render-check">(.*?)</pre>', dom.stdout, re.S)
    assert found, "the check script did not finish: " + dom.stdout[-2000:]
    check = json.loads(html.unescape(found.group(1)))
    assert check["errors"] == []
    assert check["menu"] == list(dict.fromkeys(CATEGORIES.values()))  # every category, in pipeline order
    assert set(check["shown"]) == set(plots)
    for path, img in check["shown"].items():
        assert img["category"] == CATEGORIES[plots[path]], path
        # decoded by the browser, laid out with a width, not blank, and at the PNG's size
        assert img["displayed_width"] > 100 and img["colours"] > 20, (path, img)
        assert (img["height"], img["width"]) == imread(res / "plots" / Path(path).name).shape[:2], path
    assert check["finally_shown"] == "results/e2e/plots/vocab_coverage.png"

    # a screenshot of the page showing the coverage figure: a PNG at the window size with the plot drawn
    shot = tmp_path / "report.png"
    s = _chromium(browser, tmp_path, "--window-size=1400,900", f"--screenshot={shot}", url)
    assert s.returncode == 0 and shot.is_file(), s.stderr[-3000:]
    pixels = (imread(shot)[..., :3] * 255).round()
    assert pixels.shape == (900, 1400, 3)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 200  # not a blank page
    # the coverage curve (matplotlib's C0 blue) and the chosen size's dashed line and point (C3 red)
    # are on screen (measured: about 1,100 and 140 pixels of those colours)
    for colour, pixels_at_least in (("C0", 500), ("C3", 60)):
        near = np.abs(pixels - np.array(to_rgb(colour)) * 255).sum(-1) < 40
        assert near.sum() >= pixels_at_least, colour


def test_the_lines_make_run_ends_with_give_tau_and_each_speedup_measured(tmp_path):
    """make run's last lines: the drafter's folder, then τ and the speedup per concurrency from the
    evaluation's record (rounded from its own figures); no speedup part where none was measured."""
    from eagle3_pipeline.summary import result_lines

    run = tmp_path / "results" / "r"
    (run / "eval").mkdir(parents=True)
    acc = {"acceptance_length": 1.22435, "speedup": [{"concurrency": 1, "speedup": 1.6049}, {"concurrency": 16, "speedup": 1.8551}]}
    (run / "eval" / "acceptance.json").write_text(json.dumps(acc))
    assert result_lines(str(run)).splitlines() == [
        f"drafter: {run}/drafter",
        f"acceptance: {run}/eval/acceptance.json (tau = 1.224; speedup 1.60x at 1 in flight, 1.86x at 16 in flight)",
    ]
    (run / "eval" / "acceptance.json").write_text(json.dumps(acc | {"speedup": []}))
    assert result_lines(str(run)).endswith("(tau = 1.224)")


def test_every_figure_has_its_caption_and_every_caption_a_figure():
    """report.FIGURES is the one list of figures: rule plot_run's outputs are made from it, each
    with report/<name>.rst as its caption; a caption file without a figure is a leftover."""
    root = Path(__file__).resolve().parents[1]
    captions = {p.stem for p in (root / "report").glob("*.rst")} - {"workflow"}  # the workflow's own description
    assert captions == set(FIGURES)
    assert all(f.shows and f.category[0].isdigit() and f.label for f in FIGURES.values())
