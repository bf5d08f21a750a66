import json
import os

import pytest

from bunsan.pipeline.schedules import theory_bubble
from bunsan.pipeline.timeline import LEGEND, Interval, Recorder, render_png, render_text, summarise


def gpipe_2x2():
    """p=2, m=2 GPipe; forward 1 s, backward 2 s; makespan 9 s.

    rank 0: F0 F1 [wait for grads 2..5] B0 B1
    rank 1: [recv 0..1] F0 F1 B0 B1 [send 7..7.5] [sync 7.5..9]
    """
    r0 = [
        Interval("forward", 0, 0, 0.0, 1.0),
        Interval("forward", 1, 0, 1.0, 2.0),
        Interval("recv_bwd", 0, 0, 2.0, 5.0),
        Interval("backward", 0, 0, 5.0, 7.0),
        Interval("backward", 1, 0, 7.0, 9.0),
    ]
    r1 = [
        Interval("recv_fwd", 0, 0, 0.0, 1.0),
        Interval("forward", 0, 0, 1.0, 2.0),
        Interval("forward", 1, 0, 2.0, 3.0),
        Interval("backward", 0, 0, 3.0, 5.0),
        Interval("backward", 1, 0, 5.0, 7.0),
        Interval("send_bwd", 1, 0, 7.0, 7.5),
        Interval("sync", -1, 0, 7.5, 9.0),
    ]
    return [r0, r1]


def test_summary_exact_numbers():
    s = summarise(gpipe_2x2())
    assert s.makespan == 9.0
    assert s.busy == [6.0, 6.0]
    assert s.comm_wait == [3.0, 1.5]  # sync is neither busy nor comm
    assert s.idle == [3.0, 3.0]
    assert s.bubble == pytest.approx(1 / 3)
    assert s.bubble == pytest.approx(theory_bubble("gpipe", 2, 2))
    d = json.loads(json.dumps(s.as_dict()))
    assert d["busy"] == [6.0, 6.0] and d["bubble"] == pytest.approx(1 / 3)


def test_summary_empty():
    s = summarise([[], []])
    assert s.makespan == 0.0 and s.bubble == 0.0 and s.idle == [0.0, 0.0]


def test_theory_bubble_interleaved():
    assert theory_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theory_bubble("interleaved", 4, 8, v=2) == pytest.approx(3 / 19)


def test_render_text_rows_bubble_legend():
    out = render_text(gpipe_2x2(), width=18, theory=1 / 3, theory_label="(p-1)/(m+p-1)")
    lines = out.splitlines()
    rows = [ln for ln in lines if ln.startswith("r")]
    assert len(rows) == 2
    # 2 columns per second: exact cells for this timeline.
    assert rows[0] == "r0 |0011......aaaabbbb|"
    assert rows[1] == "r1 |..0011aaaabbbb.:::|"
    assert "bubble 0.333 measured, 0.333 theory ((p-1)/(m+p-1))" in lines
    assert lines[-1] == LEGEND


def test_render_text_without_theory_and_short_spans():
    ivs = [[Interval("forward", 11, 0, 0.0, 1e-6), Interval("backward", 2, 0, 9.0, 10.0)]]
    out = render_text(ivs, width=10)
    assert out.splitlines()[0] == "r0 |B        c|"  # a tiny span still gets a cell
    assert "bubble 0.900 measured" in out and "theory" not in out.split("\n")[-2]


def test_render_png(tmp_path):
    from PIL import Image

    per_rank = gpipe_2x2()
    per_rank[1] = per_rank[1] + [Interval("forward", 2, 1, 8.0, 8.5)]  # chunk 1 shade
    target = tmp_path / "timeline.png"
    got = render_png(per_rank, target, theory=1 / 3, theory_label="gpipe", title="step 0")
    assert got == target
    assert os.listdir(tmp_path) == ["timeline.png"]  # no temp file left behind
    with Image.open(target) as img:
        img.load()
        assert img.format == "PNG" and img.mode == "RGB"
        assert img.width > 0 and img.height > 0
        colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 2
    rgb = {c for _, c in colours}
    assert (46, 94, 170) in rgb and (214, 96, 24) in rgb  # forward, backward fills


def test_render_png_failure_leaves_no_temp(tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        render_png(gpipe_2x2(), tmp_path / "t.png")
    assert os.listdir(tmp_path) == []


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_recorder_nested_relative_ordered():
    rec = Recorder(clock=FakeClock())
    rec.begin()  # t0 = 102
    with rec.record("forward", 0, 0):  # start 1
        with rec.record("send_fwd", 0, 0):  # start 2, end 3
            pass
    # end 4
    with pytest.raises(RuntimeError):
        with rec.record("backward", 0, 1):  # start 5, end 6
            raise RuntimeError
    assert rec.intervals == [
        Interval("forward", 0, 0, 1.0, 4.0),
        Interval("send_fwd", 0, 0, 2.0, 3.0),
        Interval("backward", 0, 1, 5.0, 6.0),
    ]
    old = rec.intervals
    rec.begin()
    assert rec.intervals == [] and len(old) == 3  # fresh list per step
    with rec.record("sync"):
        pass
    assert rec.intervals == [Interval("sync", -1, 0, 1.0, 2.0)]


def test_recorder_real_clock():
    rec = Recorder()
    rec.begin()
    with rec.record("forward", 0):
        with rec.record("recv_fwd", 0):
            pass
    with rec.record("backward", 0):
        pass
    ivs = rec.intervals
    assert [iv.kind for iv in ivs] == ["forward", "recv_fwd", "backward"]
    assert all(0.0 <= iv.start <= iv.end < 1.0 for iv in ivs)  # relative to begin()
    outer, inner, nxt = ivs
    assert outer.start <= inner.start <= inner.end <= outer.end <= nxt.start


def test_stage_times_average_each_global_stage():
    from bunsan.pipeline.timeline import stage_times
    per_rank = [[Interval("forward", 0, 0, 0, 1), Interval("forward", 1, 0, 1, 3), Interval("backward", 0, 1, 3, 7)],
                [Interval("forward", 0, 1, 0, 5), Interval("recv_fwd", 0, 0, 5, 6)]]
    fwd, bwd = stage_times(per_rank, p=2, v=2)     # stage = chunk * p + rank
    assert fwd == [1.5, 0.0, 0.0, 5.0] and bwd == [0.0, 0.0, 4.0, 0.0]
