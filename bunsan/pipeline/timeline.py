"""What each pipeline rank did in one step: record, summarise, draw it.

Intervals are on each rank's own clock relative to the step start (the host's, or on CUDA the GPU's, read
from events); ranks start after a barrier, so clocks are taken as aligned there."""
from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass

COMPUTE_KINDS = ("forward", "backward")
WAIT_PREFIXES = ("recv_", "send_")

_FWD_GLYPHS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LEGEND = ("legend: 0-9,A-Z forward of micro-batch n; a-z backward of micro-batch n "
          "(a=0); #,% beyond those; . send/recv; : sync/other; space idle")


@dataclass(frozen=True)
class Interval:
    kind: str   # "forward" | "backward" | "recv_fwd" | ... | "sync" | anything
    micro: int  # micro-batch, -1 when not applicable
    chunk: int  # virtual chunk, 0 without interleaving
    start: float  # seconds since the step start, this rank's clock
    end: float


def _is_wait(kind: str) -> bool:
    return kind.startswith(WAIT_PREFIXES)


class CudaClock:
    """Time on the GPU: a span's host time would count the work queued before it (and a wait for NCCL blocks
    the stream, not the host), so on CUDA each mark is an event on the current stream, read back (one sync)
    when the intervals are."""

    def __call__(self):
        import torch
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    @staticmethod
    def since(t0, mark) -> float:
        mark.synchronize()
        return t0.elapsed_time(mark) / 1e3


class Recorder:
    """Times spans of a step: ``with rec.record("forward", m, c): ...``.

    Cheap enough to leave on: open spans live in per-depth slots reused every
    step, so a span allocates only its record. ``intervals`` is in start order.
    The clock returns seconds (host) or marks that `since(t0, mark)` turns into seconds (CudaClock)."""

    __slots__ = ("_spans", "_clock", "_since", "_t0", "_open", "_depth", "_kind", "_micro", "_chunk", "_read")

    def __init__(self, clock=time.perf_counter, since=None):
        self._clock = clock  # injectable so tests can be deterministic
        self._since = since or (lambda t0, t: t - t0)
        self._open: list[list] = []  # depth -> [kind, micro, chunk, index, start]
        self.begin()

    @classmethod
    def for_device(cls, device) -> "Recorder":
        if getattr(device, "type", "cpu") == "cuda":
            clock = CudaClock()
            return cls(clock, clock.since)
        return cls()

    def begin(self) -> None:
        """Call at the step start (no span open); starts a fresh list."""
        self._spans: list = []
        self._read: list[Interval] | None = None
        self._depth = 0
        self._t0 = self._clock()

    @property
    def intervals(self) -> list[Interval]:
        """The step's spans in seconds since its start (on CUDA: after its marks have completed)."""
        if self._read is None or len(self._read) != len(self._spans):
            self._read = [Interval(k, m, c, self._since(self._t0, a), self._since(self._t0, b))
                          for k, m, c, a, b in filter(None, self._spans)]   # (a new list: callers may keep the old one)
        return self._read

    def record(self, kind: str, micro: int = -1, chunk: int = 0) -> "Recorder":
        self._kind, self._micro, self._chunk = kind, micro, chunk
        return self

    def __enter__(self) -> "Recorder":
        d = self._depth
        if d == len(self._open):
            self._open.append([None] * 5)
        slot = self._open[d]
        slot[0], slot[1], slot[2] = self._kind, self._micro, self._chunk
        slot[3] = len(self._spans)
        self._spans.append(None)  # keeps start order under nesting
        self._depth = d + 1
        slot[4] = self._clock()  # last, so bookkeeping isn't timed
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        end = self._clock()
        self._depth -= 1
        kind, micro, chunk, index, start = self._open[self._depth]
        # A failed span still happened; record it and let the error propagate.
        self._spans[index] = (kind, micro, chunk, start, end)
        return False


@dataclass
class TimelineSummary:
    makespan: float
    busy: list[float]       # per rank, forward + backward
    comm_wait: list[float]  # per rank, recv_* + send_*
    idle: list[float]       # per rank, makespan - busy
    bubble: float           # 1 - sum(busy) / (p * makespan)

    def as_dict(self) -> dict:
        return asdict(self)


def _total(ivs: list[Interval], pred) -> float:
    return sum(iv.end - iv.start for iv in ivs if pred(iv.kind))


def summarise(per_rank: list[list[Interval]]) -> TimelineSummary:
    makespan = max((iv.end for ivs in per_rank for iv in ivs), default=0.0)
    busy = [_total(ivs, COMPUTE_KINDS.__contains__) for ivs in per_rank]
    wait = [_total(ivs, _is_wait) for ivs in per_rank]
    idle = [makespan - b for b in busy]
    denom = len(per_rank) * makespan
    # An empty step has no bubble to speak of; 0 keeps as_dict() valid JSON.
    bubble = 1.0 - sum(busy) / denom if denom > 0 else 0.0
    return TimelineSummary(makespan, busy, wait, idle, bubble)


def stage_times(per_rank: list[list[Interval]], p: int, v: int = 1) -> tuple[list[float], list[float]]:
    """Mean forward and backward time of each global stage (chunk * p + rank) over a step's micro-batches."""
    sums = {k: [[0.0, 0] for _ in range(p * v)] for k in COMPUTE_KINDS}
    for rank, ivs in enumerate(per_rank):
        for iv in ivs:
            if iv.kind in sums:
                cell = sums[iv.kind][iv.chunk * p + rank]
                cell[0] += iv.end - iv.start
                cell[1] += 1
    return tuple([t / n if n else 0.0 for t, n in sums[k]] for k in COMPUTE_KINDS)


def bubble_line(bubble: float, theory: float | None = None, theory_label: str = "") -> str:
    line = f"bubble {bubble:.3f} measured"
    if theory is not None:
        line += f", {theory:.3f} theory" + (f" ({theory_label})" if theory_label else "")
    return line


def _layer(iv: Interval) -> int:
    # Drawn bottom to top: compute must stay visible over waits it overlaps.
    return 2 if iv.kind in COMPUTE_KINDS else int(_is_wait(iv.kind))


def _glyph(iv: Interval) -> str:
    if iv.kind == "forward":
        return _FWD_GLYPHS[iv.micro] if 0 <= iv.micro < len(_FWD_GLYPHS) else "#"
    if iv.kind == "backward":
        return chr(ord("a") + iv.micro) if 0 <= iv.micro < 26 else "%"
    return "." if _is_wait(iv.kind) else ":"


def _text_row(ivs: list[Interval], width: int, scale: float) -> str:
    row = [" "] * width
    for iv in sorted(ivs, key=_layer):
        c0 = min(width - 1, max(0, int(iv.start * scale)))
        # At least one column, so spans shorter than a cell still show.
        c1 = min(width, max(c0 + 1, math.ceil(iv.end * scale - 1e-9)))
        row[c0:c1] = _glyph(iv) * (c1 - c0)
    return "".join(row)


def render_text(per_rank: list[list[Interval]], width: int = 100,
                theory: float | None = None, theory_label: str = "") -> str:
    """ASCII Gantt chart: one row per rank, then time axis, bubble, legend."""
    s = summarise(per_rank)
    scale = width / s.makespan if s.makespan > 0 else 0.0
    label_w = len(f"r{max(len(per_rank) - 1, 0)}")
    lines = [f"{'r' + str(r):<{label_w}} |{_text_row(ivs, width, scale)}|"
             for r, ivs in enumerate(per_rank)]
    end = f"{s.makespan * 1e3:.3g} ms"
    lines.append(" " * (label_w + 2) + "0".ljust(max(1, width - len(end))) + end)
    lines.append(bubble_line(s.bubble, theory, theory_label))
    lines.append(LEGEND)
    return "\n".join(lines)


# PNG layout, pixels.
_W, _LEFT, _RIGHT, _LANE, _GAP = 1200, 64, 24, 30, 8
_FWD, _BWD = (46, 94, 170), (214, 96, 24)  # blue family, orange family
_WAIT, _OTHER = (205, 205, 205), (140, 140, 140)


def _shade(rgb: tuple, chunk: int, chunks: int) -> tuple:
    # Later virtual chunks lighter, so interleaved stages stay apart.
    t = 0.55 * max(chunk, 0) / max(chunks - 1, 1)
    return tuple(round(c + (255 - c) * t) for c in rgb)


def _text_center(draw, font, cx, cy, text: str, fill, max_w=math.inf) -> None:
    # Centre by bbox, not anchor=: bitmap default fonts lack anchor support.
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    if x1 - x0 <= max_w and y1 - y0 + 2 <= _LANE:  # skip labels that don't fit
        draw.text((cx - (x0 + x1) / 2, cy - (y0 + y1) / 2), text, fill=fill, font=font)


def _draw_span(draw, font, iv: Interval, x_of, y: int, chunks: int) -> None:
    x0, x1 = x_of(iv.start), max(x_of(iv.end), x_of(iv.start) + 1)
    if iv.kind not in COMPUTE_KINDS:  # waits/sync: thin bars, not work
        colour = _WAIT if _is_wait(iv.kind) else _OTHER
        draw.rectangle((x0, y + _LANE // 3, x1, y + 2 * _LANE // 3), fill=colour)
        return
    base = _FWD if iv.kind == "forward" else _BWD
    fill = _shade(base, iv.chunk, chunks)
    draw.rectangle((x0, y, x1, y + _LANE), fill=fill, outline=(40, 40, 40))
    if iv.micro >= 0:
        ink = "black" if sum(fill) > 450 else "white"
        _text_center(draw, font, (x0 + x1) / 2, y + _LANE / 2, str(iv.micro), ink, x1 - x0 - 4)


def _tick_step(span_ms: float) -> float:
    # 1-2-5 steps, about eight ticks across the axis.
    raw = span_ms / 8
    mag = 10 ** math.floor(math.log10(raw))
    return next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)


def _draw_axis(draw, font, x_of, makespan: float, y: int) -> None:
    draw.line((x_of(0), y, x_of(makespan), y), fill="black")
    span_ms = makespan * 1e3
    if span_ms <= 0:
        return
    step, i = _tick_step(span_ms), 0
    while i * step <= span_ms * (1 + 1e-9):
        x = x_of(i * step / 1e3)
        draw.line((x, y, x, y + 4), fill="black")
        _text_center(draw, font, x, y + 12, f"{round(i * step, 9):g}", "black")
        i += 1
    draw.text((_RIGHT // 2, y + 6), "ms", fill="black", font=font)


def _save_atomic(img, path) -> None:
    # Temp file beside the target, so readers never see half a PNG.
    target = os.path.abspath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".timeline-", suffix=".tmp",
                               dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as f:
            img.save(f, format="PNG")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a chart is for sharing
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def render_png(per_rank: list[list[Interval]], path, theory: float | None = None,
               theory_label: str = "", title: str = ""):
    """One lane per rank; forward blue, backward orange, chunk by shade."""
    from PIL import Image, ImageDraw, ImageFont  # only drawing needs Pillow

    s, top = summarise(per_rank), (28 if title else 10)
    axis_y = top + len(per_rank) * (_LANE + _GAP) + 4
    img = Image.new("RGB", (_W, axis_y + 56), "white")
    draw, font = ImageDraw.Draw(img), ImageFont.load_default()
    span = s.makespan if s.makespan > 0 else 1.0

    def x_of(t: float) -> float:
        return _LEFT + (_W - _LEFT - _RIGHT) * t / span

    chunks = 1 + max((iv.chunk for ivs in per_rank for iv in ivs), default=0)
    draw.text((_LEFT, 8), title, fill="black", font=font)
    for r, ivs in enumerate(per_rank):
        y = top + r * (_LANE + _GAP)
        draw.text((8, y + _LANE // 2 - 6), f"rank {r}", fill="black", font=font)
        for iv in sorted(ivs, key=_layer):
            _draw_span(draw, font, iv, x_of, y, chunks)
    _draw_axis(draw, font, x_of, s.makespan, axis_y)
    caption = bubble_line(s.bubble, theory, theory_label)
    draw.text((_LEFT, axis_y + 32), f"{caption}   makespan {s.makespan * 1e3:.3g} ms",
              fill="black", font=font)
    _save_atomic(img, path)
    return path
