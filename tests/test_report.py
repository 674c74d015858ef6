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

from autoshard.errors import ResultError
from autoshard.results import Recommendation, TrialStatus
from autoshard.ui.files import load_result, write_report
from autoshard.ui.html import render_html
from autoshard.ui.report import SCHEMA, print_summary
from tests.test_emit import all_trials, candidate, make_rec

FILES = {"report.json", "report.html", "lightning.yaml", "accelerate.yaml"}


def test_summary_says_what_won_why_and_what_was_ruled_out() -> None:
    rec = make_rec()
    console = Console(record=True, width=200)
    print_summary(rec, console, trials=all_trials(rec))
    text = console.export_text()
    assert rec.chosen.candidate.label() in text
    assert "fastest of 4 measured configurations" in text
    assert "state_dict_type=full" in text
    assert "runner-up" in text and "2,246 tokens/s" not in text.split("Alternatives")[1]
    assert "oom: CUDA out of memory" in text  # the OOM trial
    assert "does not fit" in text or "usable GPU memory" in text  # the pruned one
    # CPU trials measure without the CUDA allowance the prediction carries: both say so.
    assert "858 MiB of it the allowance for the CUDA context" in text
    assert "measured (cpu)" in text


def test_write_report_and_load_it_back(tmp_path: Path) -> None:
    rec = make_rec()
    trials = all_trials(rec)
    written = write_report(rec, tmp_path, trials)
    assert set(written) == FILES and all(p.stat().st_size > 0 for p in written.values())
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["schema"] == SCHEMA
    assert data["summary"]["label"] == rec.chosen.candidate.label()
    assert len(data["trials"]) == len(trials) == 5
    for source in (tmp_path, tmp_path / "report.json"):
        back, back_trials = load_result(source)
        assert back == rec and back_trials == trials


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


def test_html_is_self_contained_with_wellformed_charts() -> None:
    rec = make_rec()
    page = render_html(rec, all_trials(rec))
    assert "<script" not in page and "<link" not in page and "src=" not in page
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    charts = {ET.fromstring(svg).get("id"): ET.fromstring(svg) for svg in svgs}
    assert set(charts) == {"chart-memory", "chart-throughput"}
    ns = "{http://www.w3.org/2000/svg}"
    # memory: one stacked segment per non-zero term of every estimate, and a tick per measurement
    segments = [
        r for r in charts["chart-memory"].iter(f"{ns}rect") if r.find(f"{ns}title") is not None
    ]
    expected = sum(
        sum(1 for v in s.estimate.breakdown.model_dump().values() if v > 0)
        for s in (rec.chosen, *rec.runners_up, *rec.ruled_out)
        if s.estimate
    )
    assert len(segments) == expected
    ticks = [
        ln for ln in charts["chart-memory"].iter(f"{ns}line") if ln.find(f"{ns}title") is not None
    ]
    assert len(ticks) == sum(1 for t in all_trials(rec) if t.status is TrialStatus.OK)
    # throughput: one point per successful trial, the chosen one marked
    points = list(charts["chart-throughput"].iter(f"{ns}circle"))
    assert len(points) == 4 and sum(p.get("r") == "8" for p in points) == 1


def test_yaml_left_out_when_it_cannot_express_the_choice(tmp_path: Path) -> None:
    from autoshard.config import BackwardPrefetch

    rec = make_rec(candidate(backward_prefetch=BackwardPrefetch.BACKWARD_POST))
    assert set(write_report(rec, tmp_path)) == FILES - {"lightning.yaml"}


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
