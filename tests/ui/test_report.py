"""report: terminal summary, report.json / report.html / YAML files, load_result, `export`."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from autoshard.child_env import child_env
from autoshard.config import Hardware, Sharding
from autoshard.errors import ResultError
from autoshard.recommendation import Recommendation, load_result
from autoshard.results import Decision, Scored, SpeedEstimate, TrialResult, TrialStatus
from autoshard.ui.files import write_report
from autoshard.ui.html import render_html
from autoshard.ui.report import listed_rows, print_summary, report_data
from tests.test_emit import (  # noqa: F401  (gpt_importable: a fixture)
    GiB,
    all_trials,
    candidate,
    estimate,
    gpt_importable,
    make_rec,
    trial,
)


def test_summary_says_what_won_why_and_what_was_ruled_out() -> None:
    rec = make_rec()
    console = Console(record=True, width=200)
    print_summary(rec, console, trials=all_trials(rec))
    text = console.export_text()
    assert rec.chosen.candidate.label() in text
    assert "fastest of 4 measured configurations" in text
    assert "state_dict_type=full" in text
    table = text.split("Configurations")[1]
    # every trial, the chosen one first, with its measured rate per rank and spread
    assert table.count("runner-up") == 3 and "1,123 ±2%" in table.split("runner-up")[0]
    # each says what kept it out: it ran and failed, or was never launched
    assert "failed (oom): CUDA out of memory" in table  # the OOM trial
    # the pruned one: never launched, one line after the table
    assert "1 ruled out, never launched: needs more than the usable GPU memory" in table
    assert [line.split()[1] for line in table.splitlines() if "fsdp1" in line][-1] == "failed"
    # CPU trials measure without the CUDA allowance the prediction carries: both say so.
    assert "858 MiB of it the allowance for the CUDA context" in text
    assert "measured peak (cpu)" in text
    # the measured line says what its numbers cover: the rate and the peak of one rank
    assert re.search(r"tokens/s per rank \(2 ranks\), peak [\d.]+ MiB per rank on cpu", text), text
    # no speed predictions here: the measured order decided, and nothing says otherwise
    assert "trials ran on CPU processes" not in text


def test_settings_use_the_chosen_engines_own_terms() -> None:
    """FSDP2 has no auto_wrap_policy, limit_all_gathers or backward_prefetch: its summary names
    the fully_shard units, the reshard policy and the MixedPrecisionPolicy it will apply."""
    from autoshard.ui.report import settings_of

    fsdp1 = settings_of(make_rec(candidate(), basis="estimate"))
    assert fsdp1["auto_wrap_policy"] == "gpt.Block" and fsdp1["backward_prefetch"] == "BACKWARD_PRE"
    chosen = candidate(engine="fsdp2", reshard="keep_root", precision="bf16-mixed")
    fsdp2 = settings_of(make_rec(chosen, basis="estimate"))
    assert not {"auto_wrap_policy", "limit_all_gathers / forward_prefetch", "backward_prefetch",
                "sharding_strategy", "cpu_offload"} & set(fsdp2)  # fmt: skip
    assert fsdp2["engine"] == "fsdp2 (fully_shard)"
    assert fsdp2["fully_shard units"] == "each gpt.Block, then the root"
    assert fsdp2["reshard_after_forward"].startswith("reshard policy keep_root: the root stays")
    assert fsdp2["precision"] == (
        "bf16-mixed (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))"
    )
    one_unit = settings_of(make_rec(candidate(engine="fsdp2", wrap_classes=()), basis="estimate"))
    assert one_unit["fully_shard units"] == "the whole model as one unit (the root)"
    grad_op = candidate(engine="fsdp2", sharding="SHARD_GRAD_OP", precision="32-true")
    settings = settings_of(make_rec(grad_op, basis="estimate"))
    assert "reshard_after_forward=False" in settings["reshard_after_forward"]
    assert settings["precision"] == "32-true"


def test_reasons_name_the_units_in_the_engines_terms() -> None:
    from autoshard.reasons import differences as _differences
    from autoshard.space import wrap_reason
    from tests.test_emit import PROFILE

    assert wrap_reason(candidate(), PROFILE).startswith("auto_wrap_policy {gpt.Block}")
    blocks, root = candidate(engine="fsdp2"), candidate(engine="fsdp2", wrap_classes=())
    assert wrap_reason(blocks, PROFILE).startswith("fully_shard on each {gpt.Block}, then the")
    assert wrap_reason(root, PROFILE).startswith("fully_shard on the root only")
    assert _differences(blocks, root) == ["fully_shard units=none (one unit)"]
    assert _differences(candidate(), candidate(wrap_classes=())) == [
        "auto_wrap_policy=none (one unit)"
    ]


def test_estimate_reasons_do_not_give_fsdp2_fsdp1_knobs() -> None:
    import warnings

    import autoshard
    from tests.conftest import EXAMPLES

    for engine, present, absent in (
        ("fsdp2", "fully_shard's own prefetching", "backward_prefetch="),
        ("fsdp1", "backward_prefetch=BACKWARD_PRE", "fully_shard"),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", autoshard.NoGPUWarning)
            rec = autoshard.recommend(f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"},
                                      gpus=8, gpu_memory="24GiB", seq_len=32, engine=engine)  # fmt: skip
        text = "\n".join(rec.reasons)
        assert present in text and absent not in text, text


def test_progress_lines_name_each_number_and_star_only_a_ranking_measurement() -> None:
    """Without a terminal each finished trial is one line whose numbers say what they are; the
    best measured so far gets a star only where measurements rank (not CPU trials standing in
    for the planned GPUs, which the model ranks)."""
    from autoshard.config import ProgressEvent
    from autoshard.ui.progress import StudyProgress
    from tests.test_emit import estimate

    quick, slow = candidate(), candidate(sharding="SHARD_GRAD_OP")
    runs = [Scored(candidate=c, estimate=estimate(c), trial=trial(c, step))
            for c, step in ((slow, 0.30), (quick, 0.20))]  # fmt: skip
    gloo = Hardware(gpus_per_node=2, gpu_memory=2 * 2**30, backend="gloo")
    gpus = Hardware(gpus_per_node=2, gpu_memory=2 * 2**30, backend="nccl")
    for hardware, stars in ((gloo, 2), (gpus, 0), (None, 2)):
        console = Console(record=True, width=300, force_terminal=False)
        with StudyProgress(console, 2, hardware) as progress:
            for scored in runs:
                progress(ProgressEvent.DONE, scored)
        lines = console.export_text().splitlines()
        assert len(lines) == 2 and all(line.startswith("trial: ") for line in lines)
        assert sum("★" in line for line in lines) == stars, (hardware, lines)
        assert "ok  0.200 s/step on cpu  peak 53.4 MiB (predicted " in lines[1]
        assert lines[1].endswith("1,280 tok/s per rank" + (" ★" if stars else ""))


def test_the_terminal_says_a_repeated_reason_once() -> None:
    """Candidates never launched for one reason are one line after the table, with how many
    (a row each repeated a 5-line reason 32 times); what ran keeps its row."""
    rec = make_rec()
    why = "offload needs a GPU"
    skipped = [
        Scored(
            candidate=candidate(cpu_offload=True, micro_batch_size=m),
            trial=TrialResult(
                candidate=candidate(cpu_offload=True, micro_batch_size=m),
                status=TrialStatus.SKIPPED,
                error=why,
            ),
        )
        for m in (1, 2, 4, 8, 16)
    ]
    rec = rec.model_copy(update={"ruled_out": [*rec.ruled_out, *skipped]})
    console = Console(record=True, width=250)
    print_summary(rec, console, trials=all_trials(rec))
    text = console.export_text()
    assert text.count(why) == 1
    assert "5 skipped, never launched: offload needs a GPU" in text
    # the pruned candidate too: one line in the outcome's word, after the table
    assert "1 ruled out, never launched: needs more than the usable GPU memory" in text
    table = text.split("Configurations")[1].split("└")[0]
    assert "(oom): CUDA out of memory" in table and "usable GPU memory" not in table


def test_load_tune_output_folder(tmp_path: Path) -> None:
    """What `tune` writes: recommendation.json and trials.jsonl."""
    rec = make_rec()
    (tmp_path / "recommendation.json").write_text(rec.model_dump_json(indent=2))
    trials = all_trials(rec)
    (tmp_path / "trials.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in trials))
    assert load_result(tmp_path) == (rec, trials)


def test_load_estimate_json_reads_the_decision_it_carries(tmp_path: Path) -> None:
    """Export never chooses: it reads the pipeline's decision out of `estimate --json`, even
    when the list is ordered otherwise (here the first fitting estimate is a runner-up)."""
    rec = make_rec(basis="estimate")
    ests = [s.estimate for s in (*rec.ruled_out, *rec.runners_up, rec.chosen)]
    data = {
        "profile": rec.profile.model_dump(mode="json"),
        "hardware": rec.hardware.model_dump(mode="json"),
        "workload": rec.workload.model_dump(mode="json"),
        "recommendation": rec.model_dump(mode="json"),
        "estimates": [e.model_dump(mode="json") for e in ests if e],
    }
    path = tmp_path / "estimate.json"
    path.write_text(json.dumps(data))
    back, trials = load_result(path)
    assert back == rec and trials == []
    first_fit = next(e for e in ests if e and e.fits)
    assert first_fit.candidate != rec.chosen.candidate  # the list's order was not used
    data["recommendation"] = None
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match="no candidate fits"):
        load_result(path)
    del data["recommendation"]
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match="carries no recommendation"):
        load_result(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "no such file"),
        ("{not json", "not a JSON result"),
        ('{"hello": 1}', "not an autoshard result"),
        ('{"profile": {}, "chosen": {}}', r"not an autoshard result \(profile"),
    ],
)
def test_bad_results_are_one_line_errors(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultError, match=match) as info:
        load_result(path)
    assert "\n" not in str(info.value)


def test_folder_without_results(tmp_path: Path) -> None:
    with pytest.raises(ResultError, match=r"no report\.json or recommendation\.json"):
        load_result(tmp_path)


NS = "{http://www.w3.org/2000/svg}"


def chart(page: str, name: str) -> ET.Element:
    svg = re.search(rf'<svg id="{name}".*?</svg>', page, flags=re.S)
    assert svg is not None, name
    return ET.fromstring(svg.group(0))


def with_speeds(
    rec: Recommendation, gpu: str, step: float = 0.1, uncalibrated: tuple[str, ...] = ()
) -> Recommendation:
    """The recommendation with a speed prediction on every estimate, calibrated but for the
    candidates labelled in ``uncalibrated``."""

    def predicted(s: Scored) -> Scored:
        if s.estimate is None:
            return s
        mbs = s.candidate.micro_batch_size
        t = step / mbs**0.8
        speed = SpeedEstimate(step_time_s=t, samples_per_s=2 * mbs / t,
                              tokens_per_s_per_gpu=mbs * 128 / t, gpu=gpu,
                              calibrated=s.candidate.label() not in uncalibrated)  # fmt: skip
        return s.model_copy(update={"estimate": s.estimate.model_copy(update={"speed": speed})})

    return rec.model_copy(
        update={
            "chosen": predicted(rec.chosen),
            "runners_up": tuple(map(predicted, rec.runners_up)),
            "ruled_out": tuple(map(predicted, rec.ruled_out)),
        }
    )


# ---------------------------------------------------------------------------------------------
# `autoshard export`
# ---------------------------------------------------------------------------------------------


def test_export_cli(cli, tmp_path: Path) -> None:
    rec = make_rec()
    write_report(rec, tmp_path / "out")
    code, out, _ = cli("export", tmp_path / "out")
    assert code == 0 and "class_path: lightning.pytorch.strategies.FSDPStrategy" in out
    code, out, _ = cli("export", tmp_path / "out" / "report.json", "--format", "accelerate")
    assert code == 0 and "fsdp_config:" in out and "mixed_precision: bf16" in out
    code, _, err = cli("export", tmp_path / "out", "-f", "json", "-o", tmp_path / "r.json")
    assert code == 0 and "wrote" in err
    assert Recommendation.model_validate_json((tmp_path / "r.json").read_text()) == rec


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["nowhere"], "nowhere: no such file or folder"),
        (["OUT", "--format", "toml"], "--format toml: choose one of lightning"),
        (["OUT", "-o", "/nonexistent-dir/x.yaml"], "cannot write"),
    ],
)
def test_export_cli_errors_are_one_line(cli, tmp_path: Path, args: list[str], match: str) -> None:
    write_report(make_rec(), tmp_path)
    code, _, err = cli("export", *[str(tmp_path) if a == "OUT" else a for a in args])
    assert code == 1 and match in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# The page in a real browser
# ---------------------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    rec = make_rec()
    write_report(rec, tmp_path / "out", all_trials(rec))
    url = (tmp_path / "out" / "report.html").as_uri()
    profile = f"--user-data-dir={tmp_path / 'chromium'}"
    shot = tmp_path / "shot.png"
    run = [CHROMIUM, *FLAGS, profile, "--window-size=1100,1600"]
    subprocess.run([*run, f"--screenshot={shot}", url], capture_output=True, timeout=60, check=True)
    dom = subprocess.run(
        [*run, "--dump-dom", url], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert 'id="chart-memory"' in dom and 'id="chart-throughput"' in dom
    assert rec.chosen.candidate.label() in dom
    pixels = read_png(shot)
    assert pixels.shape == (1600, 1100, 3)
    stddev = float(pixels.std())
    assert stddev > 20, f"screenshot looks blank (pixel stddev {stddev:.1f})"
    # The charts are on screen, not only in the DOM: the activations red of the memory bars.
    red = np.all(np.abs(pixels.astype(int) - (0xE1, 0x57, 0x59)) < 8, axis=-1)
    assert red.sum() > 1000


def _with_skipped(rec: Decision, n: int = 5) -> Decision:
    """``rec`` with ``n`` offload candidates the CPU workers skipped (never launched)."""
    skipped = []
    for m in range(n):
        c = candidate(cpu_offload=True, micro_batch_size=m + 1)
        skipped.append(Scored(candidate=c, estimate=estimate(c), trial=TrialResult(
            candidate=c, status=TrialStatus.SKIPPED, error="offload needs a GPU")))  # fmt: skip
    return rec.model_copy(update={"ruled_out": [*rec.ruled_out, *skipped]})


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_report_in_chromium_draws_skipped_candidates_apart_from_failures(tmp_path: Path) -> None:
    """Measured, failed (ran: an OOM), skipped (never launched) and ruled out (predicted not to
    fit) are four different things in every chart and table of the rendered page."""
    rec = with_speeds(_with_skipped(make_rec()), "h100-sxm")
    trials = all_trials(rec)
    write_report(rec, tmp_path / "out", trials)
    url = (tmp_path / "out" / "report.html").as_uri()
    run = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1100,2600"]
    shot = tmp_path / "shot.png"
    subprocess.run([*run, f"--screenshot={shot}", url], capture_output=True, timeout=60, check=True)
    assert float(read_png(shot).std()) > 20  # it rendered
    dom = subprocess.run(
        [*run, "--dump-dom", url], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    scatter = dom.split('id="chart-throughput"')[1].split("</svg>")[0]
    # Only the OOM trial is a failure; the five skipped and the pruned one never ran.
    assert "1 failed (oom / error / timeout)" in scatter
    assert scatter.count('data-outcome="failed"') == 2  # its mark and the count
    assert "1 ruled out and 5 skipped: never launched, not drawn" in scatter
    memory = dom.split('id="chart-memory"')[1].split("</svg>")[0]
    assert memory.count('data-outcome="skipped"') == 5
    assert memory.count("(skipped, never launched)") == 5
    assert memory.count('fill-opacity="0.35"') >= 5 * 4  # faint bars: an estimate, no run
    # each outcome its own mark on its rows and in the legend
    for word, rows in (("measured", 4), ("failed", 1), ("skipped", 5), ("ruled out", 1)):
        assert memory.count(f'data-mark="{word}"') == rows + 1, word
        assert f'data-legend="{word}"' in memory, word
    speed = dom.split('id="chart-speed"')[1].split("</svg>")[0]
    # a skipped candidate's prediction is hollow, never the measured bars' solid colour
    assert speed.count('data-kind="predicted, never launched"') == 5
    assert 'data-key="predicted, never launched"' in speed
    table = dom.split('id="configurations"')[1].split("</table>")[0]
    outcomes = re.findall(r'<tr[^>]*data-outcome="([^"]+)"', table)
    assert outcomes.count("failed") == 1 and outcomes.count("measured") == 4
    # those never launched: a row per reason, the reason once, their labels folded under it
    assert outcomes.count("skipped") == 1 and outcomes.count("ruled out") == 1
    assert 'data-count="5"' in table and table.count("offload needs a GPU") == 1
    assert "5 skipped, never launched: offload needs a GPU" in table
    assert "model error" not in table  # CPU trials: no model error to show, no empty column


BOXES = """<script>
addEventListener("load", () => {
  const out = [];
  for (const svg of document.querySelectorAll("svg")) {
    const vb = svg.viewBox.baseVal;
    for (const t of svg.querySelectorAll("text")) {
      const b = t.getBBox();
      out.push({svg: svg.id, cls: t.getAttribute("class") || "", text: t.textContent,
                x: b.x, y: b.y, w: b.width, h: b.height, vbw: vb.width, vbh: vb.height});
    }
  }
  document.body.setAttribute("data-boxes", JSON.stringify(out));
});
</script>"""


def _long_labels(rec: Decision) -> Decision:
    """``rec`` with candidates whose labels are as long as a tune's get, never launched."""
    long = [
        candidate(checkpointing="selective", cpu_offload=True, compile=True, micro_batch_size=16),
        candidate(sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 1), checkpointing="every_k",
                  checkpoint_every=2, compile=True, precision="32-true"),
    ]  # fmt: skip
    kept = [
        Scored(candidate=c, estimate=estimate(c), trial=TrialResult(
            candidate=c, status=TrialStatus.SKIPPED, error="offload needs a GPU"))
        for c in long
    ]  # fmt: skip
    return rec.model_copy(update={"ruled_out": [*rec.ruled_out, *kept]})


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_report_labels_are_never_clipped_in_chromium(tmp_path: Path) -> None:
    """The page in a real browser, a screenshot taken, and every text of every chart measured
    by the browser (``getBBox``): inside its chart, labels left of the plot; a candidate
    predicted not to fit is drawn past the usable line (the labels were cut on the left:
    "D_GRAD_OP bf16-mixed nowrap...")."""
    rec = with_speeds(_long_labels(_with_skipped(make_rec())), "h100-sxm")
    write_report(rec, tmp_path / "out", all_trials(rec))
    page = (tmp_path / "out" / "report.html").read_text()
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", BOXES + "</body>"))
    run = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1300,3000"]
    shot = tmp_path / "shot.png"
    subprocess.run([*run, f"--screenshot={shot}", (tmp_path / "out" / "report.html").as_uri()],
                   capture_output=True, timeout=60, check=True)  # fmt: skip
    assert float(read_png(shot).std()) > 20  # it rendered
    dom = subprocess.run(
        [*run, "--virtual-time-budget=5000", "--dump-dom", measured.as_uri()],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    found = re.search(r'data-boxes="([^"]*)"', dom)
    assert found, dom[:500]
    import html as html_module

    boxes = json.loads(html_module.unescape(found.group(1)))
    labels = [b for b in boxes if "label" in b["cls"].split()]
    longest = max(c.label() for c in (s.candidate for _, s in listed_rows(rec)))
    assert any(b["text"] == longest for b in labels)
    assert len(labels) >= 2 * 12  # the memory and the speed chart's rows
    for b in boxes:
        where = f"{b['svg']}: {b['text']!r} at x {b['x']:.1f}..{b['x'] + b['w']:.1f} of {b['vbw']}"
        assert b["x"] >= 0 and b["x"] + b["w"] <= b["vbw"] + 0.5, where
        assert b["y"] >= 0 and b["y"] + b["h"] <= b["vbh"] + 0.5, where
    # every label ends before its chart's bars begin (the mark's column between them)
    memory = chart(page, "chart-memory")
    bars_start = min(float(r.get("x")) for r in memory.iter(f"{NS}rect") if r.get("data-kind"))
    assert all(b["x"] + b["w"] <= bars_start for b in labels if b["svg"] == "chart-memory")
    # a candidate predicted not to fit ends past the usable line
    usable = next(ln for ln in memory.iter(f"{NS}line") if ln.get("data-limit") == "usable")
    ruled = [r for r in memory.iter(f"{NS}rect") if r.get("data-bar") == "ruled out"]
    assert ruled and all(float(r.get("data-end")) > float(usable.get("x1")) for r in ruled)


def test_report_json_counts_the_four_outcomes() -> None:
    rec = _with_skipped(make_rec())
    counts = report_data(rec, all_trials(rec))["summary"]["outcomes"]
    assert counts == {"measured": 4, "diverged": 0, "failed": 1, "skipped": 5, "ruled out": 1}


def read_png(path: Path) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) with zlib and numpy; no Pillow."""
    data = path.read_bytes()
    pos, idat, header = 8, b"", (0, 0, 0, 0)
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, chunk = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat += chunk
    width, height, depth, colour = header
    assert depth == 8 and colour in (2, 6), header
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((height, width * bpp), np.uint8)
    prev = np.zeros(width * bpp, np.uint8)
    for y in range(height):
        f, line = raw[y, 0], raw[y, 1:]
        if f == 0:
            row = line.copy()
        elif f == 2:
            row = line + prev
        elif f == 1:  # Sub: a running sum per channel
            row = np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint64).astype(np.uint8).ravel()
        else:  # Average and Paeth depend on the byte to the left: decode byte by byte
            row_l, up = bytearray(line.tobytes()), prev.tobytes()
            for i in range(len(row_l)):
                a = row_l[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    row_l[i] = (row_l[i] + (a + b) // 2) & 0xFF
                    continue
                c = up[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                row_l[i] = (row_l[i] + pred) & 0xFF
            row = np.frombuffer(bytes(row_l), np.uint8)
        out[y] = prev = row
    return out.reshape(height, width, bpp)[..., :3]


@pytest.mark.slow
def test_a_study_in_which_nothing_ran_writes_its_report(tmp_path: Path) -> None:
    """Every trial fails (the model raises in every rank's forward): ``tune`` ends with one line
    and exit code 1, and still writes report.json and report.html, which say the same line and
    list every trial with what kept it out; reading the folder back says it in one line."""
    import sys

    from tests.conftest import ROOT, TARGETS

    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "autoshard", "tune", f"{TARGETS}/faults.py:build",
        "--arg", "fault=raise", "--arg", "rank=-1", "--arg", "message=broken on purpose",
        "--seq-len", "16", "--gpu-memory", "4GiB", "--precision", "32-true", "--trials", "3",
        "--warmup", "1", "--steps", "2", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        args, cwd=ROOT, env=child_env(ROOT), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert "no configuration ran successfully" in line and "broken on purpose" in line
    data = json.loads((out / "report.json").read_text())
    assert data["recommendation"] is None and data["error"] in line
    failed = [t for t in data["trials"] if t["status"] == "error"]
    assert failed and data["summary"]["outcomes"]["failed"] == len(failed)
    page = (out / "report.html").read_text()
    assert "no configuration ran" in page and "broken on purpose" in page
    table = page.split('id="configurations"')[1].split("</table>")[0]
    assert table.count('data-outcome="failed"') == len(failed)
    assert not (out / "lightning.yaml").exists()  # nothing to train with
    with pytest.raises(ResultError, match="ended without a recommendation: no configuration ran"):
        load_result(out)


def test_an_uncalibrated_prediction_is_not_shown_as_a_peer_of_calibrated_ones() -> None:
    """GPU trials each put against the prediction they were tried with: the first, made before
    any trial calibrated the model, says so beside its error (the GPU run's "model +2999%"
    stood beside calibrated ones as if it were one of them)."""
    gpus = Hardware(gpus_per_node=2, gpu_memory=2 * GiB, gpu="h100-sxm")
    rec = with_speeds(make_rec(hardware=gpus), "h100-sxm")

    def on_cuda(s: Scored, calibrated: bool) -> Scored:
        trial = s.trial.model_copy(update={"device": "cuda"}) if s.trial else None
        speed = s.estimate.speed.model_copy(update={"calibrated": calibrated})
        return s.model_copy(update={"trial": trial, "estimate": s.estimate.model_copy(
            update={"speed": speed})})  # fmt: skip

    rec = rec.model_copy(update={
        "chosen": on_cuda(rec.chosen, True),
        "runners_up": tuple(on_cuda(s, i != 0) for i, s in enumerate(rec.runners_up)),
        "ruled_out": tuple(on_cuda(s, True) for s in rec.ruled_out),
    })  # fmt: skip
    console = Console(record=True, width=250)
    print_summary(rec, console, all_trials(rec))
    text = console.export_text()
    assert text.count(", uncalibrated)") == 1 and text.count("(model ") == 4
    first = rec.runners_up[0].candidate.label()
    assert ", uncalibrated)" in next(line for line in text.splitlines() if first in line)
    table = render_html(rec, all_trials(rec)).split('id="configurations"')[1]
    assert table.count(", uncalibrated<") == 1


# ---------------------------------------------------------------------------------------------
# One number, one unit, in every view: the command line, Python, report.json, report.html
# ---------------------------------------------------------------------------------------------


def _views(rec: Decision, tmp_path: Path) -> tuple[str, str, dict, str]:
    """What the command line prints, ``print(rec)``, report.json and report.html of ``rec``."""
    console = Console(record=True, width=250)
    print_summary(rec, console, all_trials(rec))
    write_report(rec, tmp_path, all_trials(rec))
    data = json.loads((tmp_path / "report.json").read_text())
    return console.export_text(), str(rec), data, (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_measured_rate_is_one_rank_s_in_every_view(tmp_path: Path, device: str) -> None:
    """``rec.chosen.trial.tokens_per_s`` was the ranks summed (8,237) where the command line
    said 4,119 per rank: every view now shows one rank's, labelled."""
    rec = make_rec()
    trials = {"chosen": rec.chosen.trial.model_copy(update={"device": device})}
    rec = rec.model_copy(
        update={"chosen": rec.chosen.model_copy(update=dict(trial=trials["chosen"]))}
    )
    cli, printed, data, page = _views(rec, tmp_path)
    t = rec.chosen.trial
    per = "per GPU" if device == "cuda" else "per rank"
    shown = f"{t.tokens_per_s_per_gpu:,.0f} tokens/s {per}"
    assert t.tokens_per_s_per_gpu == t.tokens_per_s / t.world_size  # Python: one rank's
    assert shown in next(line for line in cli.splitlines() if line.startswith("measured"))  # CLI
    assert shown in printed  # print(rec)
    assert data["summary"]["measured"]["tokens_per_s_per_gpu"] == t.tokens_per_s_per_gpu  # JSON
    assert data["summary"]["settings"]["measured"].count(shown) == 1
    assert f"<th>measured</th><td>{data['summary']['settings']['measured']}</td>" in page  # HTML
    rows = page.split('id="configurations"')[1]
    assert f"{t.tokens_per_s_per_gpu:,.0f} tokens/s ±" in rows


@pytest.mark.usefixtures("gpt_importable")
@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
def test_the_reduce_dtype_is_the_candidates_in_every_view(tmp_path: Path, engine: str) -> None:
    """report.json said ``reduce_dtype_fp32: true`` while FSDP1's ``fsdp_kwargs()`` reduced in
    bf16: every output reads the candidate's field, and FSDP1's says what it does."""
    import torch

    from autoshard.sharding import fsdp2_kwargs

    rec = make_rec(candidate(engine=engine))
    cli, _, data, page = _views(rec, tmp_path)
    c = rec.chosen.candidate
    if engine == "fsdp1":
        reduce = rec.fsdp_kwargs(device=torch.device("cpu"))["mixed_precision"].reduce_dtype
    else:
        reduce = fsdp2_kwargs(c, None, pin_memory=False)["mp_policy"].reduce_dtype
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[reduce]  # Python: what torch gets
    assert c.reduce_dtype_fp32 == (name == "fp32") == (engine == "fsdp2")
    assert data["recommendation"]["chosen"]["candidate"]["reduce_dtype_fp32"] == c.reduce_dtype_fp32
    assert data["summary"]["settings"]["gradients reduced in"] == name  # JSON
    assert re.search(rf"gradients reduced in\s+{name}\b", cli)  # CLI
    assert f"<th>gradients reduced in</th><td>{name}</td>" in page  # HTML


def test_outcomes_are_counted_in_the_same_words_in_every_view(tmp_path: Path) -> None:
    """``print(rec)`` said "32 ruled out" where ``summary.outcomes`` said skipped 32, ruled
    out 0: one table of outcomes (results.OUTCOMES) words every view."""
    rec = _with_skipped(make_rec(), n=5)
    cli, printed, data, page = _views(rec, tmp_path)
    counts = data["summary"]["outcomes"]
    assert counts == {"measured": 4, "diverged": 0, "failed": 1, "skipped": 5, "ruled out": 1}
    assert rec.outcome_counts() == counts  # Python
    assert "4 measured (the chosen and 3 runners-up), 1 failed, 5 skipped, 1 ruled out" in printed
    assert "5 skipped, never launched: offload needs a GPU" in cli  # CLI
    assert "1 ruled out, never launched: " in cli
    table = page.split('id="configurations"')[1].split("</table>")[0]  # HTML
    groups = dict(re.findall(r'data-outcome="([^"]+)" data-count="(\d+)"', table))
    assert groups == {"skipped": "5", "ruled out": "1"}
    rows = re.findall(r'<tr[^>]*data-outcome="([^"]+)">', table)
    assert rows.count("measured") == 4 and rows.count("failed") == 1
