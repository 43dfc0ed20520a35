"""Aggregation of per-utterance results and the markdown report (tables like the
paper's Table 2 and Table 3)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

# a row of the report: one system (ground truth, codec, or the model in one mode at one lambda)
GT, CODEC, MODEL = "ground truth", "codec resynthesis", "model"
# the codec's encoder output decoded without quantisation: what the codebooks cost
CODEC_LATENT = "codec, unquantised latent"


def row_label(system: str, mode: Optional[str] = None, lam: Optional[float] = None) -> str:
    if system != MODEL:
        return system
    return f"{mode} (λ={fmt_lambda(lam)})"


def fmt_lambda(lam: Optional[float]) -> str:
    if lam is None:
        return "-"
    if lam == float("inf"):
        return "inf"
    return f"{lam:g}"


@dataclass
class RowStats:
    label: str
    n: int = 0
    n_failed: int = 0
    wer: Optional[float] = None  # fraction
    cer: Optional[float] = None
    sim_train: Optional[float] = None
    sim_heldout: Optional[float] = None
    n_train: int = 0
    n_heldout: int = 0
    id_acc: Optional[float] = None  # held-out identification accuracy (fraction)
    id_top5: Optional[float] = None
    id_variant: Optional[float] = None  # top-1 against held-out voices of other variants
    id_margin: Optional[float] = None
    mos: Optional[float] = None
    rtf: Optional[float] = None  # total compute / total audio
    ttfa_ms: Optional[float] = None  # median
    dur_ratio: Optional[float] = None  # mean generated duration / ground truth duration
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def _mean(xs: Iterable[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return float(statistics.fmean(xs)) if xs else None


def aggregate(label: str, records: Sequence[dict]) -> RowStats:
    """Records are the per-utterance dicts written to the JSON (see evaluate.py)."""
    ok = [r for r in records if not r.get("error")]
    st = RowStats(label, n=len(ok), n_failed=len(records) - len(ok))
    scored = [r for r in ok if r.get("ref_words") is not None and r.get("word_errors") is not None]
    if scored:
        st.wer = sum(r["word_errors"] for r in scored) / max(1, sum(r["ref_words"] for r in scored))
        st.cer = sum(r["char_errors"] for r in scored) / max(1, sum(r["ref_chars"] for r in scored))
    train = [r["sim"] for r in ok if not r["heldout_voice"] and r.get("sim") is not None]
    held = [r["sim"] for r in ok if r["heldout_voice"] and r.get("sim") is not None]
    st.n_train, st.n_heldout = len(train), len(held)
    st.sim_train, st.sim_heldout = _mean(train), _mean(held)
    ids = [r for r in ok if r["heldout_voice"] and r.get("id_correct") is not None]
    if ids:
        st.id_acc = sum(bool(r["id_correct"]) for r in ids) / len(ids)
        ranks = [r["id_rank"] for r in ids if r.get("id_rank") is not None]
        st.id_top5 = sum(k <= 5 for k in ranks) / len(ranks) if ranks else None
        var = [bool(r["id_variant_correct"]) for r in ids if r.get("id_variant_correct") is not None]
        st.id_variant = sum(var) / len(var) if var else None
        st.id_margin = _mean(r["id_margin"] for r in ids)
    st.mos = _mean(r.get("mos") for r in ok)
    comp = [(r["compute_s"], r["audio_s"]) for r in ok if r.get("compute_s") is not None and r.get("audio_s")]
    if comp:
        st.rtf = sum(c for c, _ in comp) / max(1e-9, sum(a for _, a in comp))
    ttfa = [r["ttfa_s"] for r in ok if r.get("ttfa_s") is not None]
    if ttfa:
        st.ttfa_ms = 1000.0 * statistics.median(ttfa)
    st.dur_ratio = _mean(r["audio_s"] / r["ref_duration_s"] for r in ok if r.get("audio_s") and r.get("ref_duration_s"))
    return st


def _pct(x: Optional[float]) -> Optional[str]:
    return None if x is None else f"{100 * x:.1f}"


def _f(x: Optional[float], digits: int = 3) -> Optional[str]:
    return None if x is None else f"{x:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in headers) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Optional[str], na: Optional[str], empty: str = "–") -> str:
    if na is not None:
        return na
    return empty if value is None else value


def table2(rows: Sequence[RowStats], na: dict[str, Optional[str]]) -> str:
    """na: metric -> "n/a (...)" when its backend is unavailable ('asr', 'sim', 'mos')."""
    headers = ["System", "WER %", "CER %", "SIM train voices", "SIM held-out voices", "held-out ID % (top-1 / top-5 / variant)",
               "MOS", "RTF", "TTFA ms", "dur/GT", "n"]
    out = []
    for st in rows:
        timing = st.label not in (GT,)
        out.append([
            st.label,
            _cell(_pct(st.wer), na.get("asr")),
            _cell(_pct(st.cer), na.get("asr")),
            _cell(_f(st.sim_train) and f"{_f(st.sim_train)} ({st.n_train})", na.get("sim")),
            _cell(_f(st.sim_heldout) and f"{_f(st.sim_heldout)} ({st.n_heldout})", na.get("sim")),
            _cell(_pct(st.id_acc) and f"{_pct(st.id_acc)} / {_pct(st.id_top5) or '–'} / {_pct(st.id_variant) or '–'}",
                  na.get("sim")),
            _cell(_f(st.mos, 2), na.get("mos")),
            _cell(_f(st.rtf, 3) if timing else None, None),
            _cell(None if st.ttfa_ms is None else f"{st.ttfa_ms:.0f}", None),
            _cell(_f(st.dur_ratio, 2) if st.label != GT else None, None),
            f"{st.n}" + (f" (+{st.n_failed} failed)" if st.n_failed else ""),
        ])
    return markdown_table(headers, out)


def table3(rows: Sequence[tuple[str, str, RowStats]], na: dict[str, Optional[str]]) -> str:
    """rows: (mode, lambda string, stats)."""
    headers = ["Mode", "guidance λ", "WER %", "CER %", "SIM train voices", "SIM held-out voices", "MOS", "n"]
    out = []
    for mode, lam, st in rows:
        out.append([
            mode, lam,
            _cell(_pct(st.wer), na.get("asr")),
            _cell(_pct(st.cer), na.get("asr")),
            _cell(_f(st.sim_train), na.get("sim")),
            _cell(_f(st.sim_heldout), na.get("sim")),
            _cell(_f(st.mos, 2), na.get("mos")),
            f"{st.n}" + (f" (+{st.n_failed} failed)" if st.n_failed else ""),
        ])
    return markdown_table(headers, out)
