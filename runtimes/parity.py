"""Parity: an artifact against the eager reference on many inputs, decisions first, then values.

Inputs span batch sizes, lengths (1 to the model's maximum), padded rows, and the task's
difficulty levels (so every budget occurs) plus random token soup. For each layer's decisions
(k, head mask) a flip is excused only when the reference sat within a stated margin of the
boundary: |s*H - round(s*H)| for k, the gap between the k-th and (k+1)-th head preference for the
head set. Values are then compared with the artifact's routing replayed in the reference wherever
an excused flip happened, so one excused flip does not read as a numeric failure.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from adaptex.graphs.tasks import get_task
from adaptex.runtimes.base import Runner
from adaptex.runtimes.torch_ref import TorchRunner

# Tolerances by body precision (DESIGN §4); never loosened silently.
TOLERANCES = {"fp32": {"atol": 1e-4, "rtol": 1e-3}, "fp16": {"atol": 1e-2, "rtol": 1e-2}}
# Decision margins: a flip is excused only when the reference was closer than this to the boundary.
MARGINS = {"fp32": {"k": 1e-4, "head_mask": 1e-5, "keep": 1e-4, "sa": 1e-4},
           "fp16": {"k": 1e-2, "head_mask": 1e-3, "keep": 1e-2, "sa": 1e-2}}


@dataclass
class OutputStat:
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    needed_atol: float = 0.0  # the smallest atol that passes at the stated rtol
    worst_input: str = ""


@dataclass
class DecisionStat:
    compared: int = 0
    agreed: int = 0
    excused: int = 0
    unexcused: int = 0
    values_seen: dict = field(default_factory=dict)  # k -> count (k decisions only)

    def count(self, flip: np.ndarray, excusable: np.ndarray, where: np.ndarray | None = None) -> None:
        """Fold one batch in: `flip` where artifact and reference disagree, `excusable` where the
        reference sat within the margin; `where` limits the count (e.g. to real tokens)."""
        w = np.ones_like(flip, dtype=bool) if where is None else where
        self.compared += int(w.sum())
        self.agreed += int((~flip & w).sum())
        self.excused += int((flip & excusable & w).sum())
        self.unexcused += int((flip & ~excusable & w).sum())


@dataclass
class ParityReport:
    artifact: str
    runtime: str
    precision: str
    tolerance: dict
    margins: dict
    samples: int = 0
    batches: int = 0
    outputs: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    note: str = ""

    @property
    def max_abs_err(self) -> float:
        return max((o.max_abs_err for o in self.outputs.values()), default=0.0)

    @property
    def unexcused_flips(self) -> int:
        return sum(d.unexcused for d in self.decisions.values())

    @property
    def excused_flips(self) -> int:
        return sum(d.excused for d in self.decisions.values())

    @property
    def decision_agreement(self) -> float:
        c = sum(d.compared for d in self.decisions.values())
        return sum(d.agreed for d in self.decisions.values()) / c if c else 1.0

    @property
    def decisions_vary(self) -> bool:
        ks = [d for n, d in self.decisions.items() if n.endswith((".k", ".keep", ".sa"))]
        return any(len(d.values_seen) > 1 for d in ks)

    @property
    def passed(self) -> bool:
        return not self.failures and self.samples > 0

    def to_dict(self) -> dict:
        return {
            "passed": self.passed, "artifact": self.artifact, "runtime": self.runtime,
            "precision": self.precision, "samples": self.samples, "batches": self.batches,
            "max_abs_err": self.max_abs_err,
            "max_rel_err": max((o.max_rel_err for o in self.outputs.values()), default=0.0),
            "tolerance": self.tolerance, "margins": self.margins,
            "decision_agreement": self.decision_agreement,
            "unexcused_flips": self.unexcused_flips, "excused_flips": self.excused_flips,
            "decisions_vary": self.decisions_vary,
            "outputs": {k: asdict(v) for k, v in self.outputs.items()},
            "decisions": {k: {**asdict(v), "values_seen": {str(a): b for a, b in sorted(v.values_seen.items())}}
                          for k, v in self.decisions.items()},
            "failures": self.failures[:50], "note": self.note,
        }

    def format(self) -> str:
        tol = self.tolerance
        lines = [f"parity: {self.artifact} on {self.runtime} against eager PyTorch (hard mode)",
                 f"  {self.samples} sequences in {self.batches} batches; {self.precision} tolerance "
                 f"atol={tol['atol']:g} rtol={tol['rtol']:g}"]
        if self.note:
            lines.append(f"  note: {self.note}")
        lines.append(f"  {'output':<30} {'max abs':>10} {'max rel':>10} {'needs atol':>11}")
        for name, o in self.outputs.items():
            lines.append(f"  {name:<30} {o.max_abs_err:10.2e} {o.max_rel_err:10.2e} {o.needed_atol:11.2e}")
        lines.append(f"  {'decision':<30} {'agree':>10} {'excused':>8} {'unexcused':>10}  values seen")
        for name, d in self.decisions.items():
            seen = ",".join(f"{k}:{v}" for k, v in sorted(d.values_seen.items())) if d.values_seen else ""
            lines.append(f"  {name:<30} {d.agreed / max(d.compared, 1):10.4f} {d.excused:8d} {d.unexcused:10d}  {seen}")
        for f in self.failures[:10]:
            lines.append(f"  FAIL {f}")
        if len(self.failures) > 10:
            lines.append(f"  ... and {len(self.failures) - 10} more failures")
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"  {verdict}: decision agreement {self.decision_agreement:.4f}, "
                     f"unexcused flips {self.unexcused_flips}, max abs error {self.max_abs_err:.2e}")
        if not self.decisions_vary and self.decisions:
            lines.append("  warning: the decisions were the same on every input; the checked inputs did not exercise the routing")
        return "\n".join(lines)


def parity_inputs(cfg, task_name: str | None, samples: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Batches totalling `samples` sequences: varied batch sizes, lengths, padding and difficulty."""
    rng = np.random.default_rng(seed)
    task = None
    if task_name:
        try:
            task = get_task(task_name)
        except Exception:  # an unknown or unavailable task: fall back to random tokens
            task = None
    batch_sizes = [1, 2, 3, 4, 8, 16]
    feeds, total, i = [], 0, 0
    while total < samples:
        B = min(batch_sizes[i % len(batch_sizes)], samples - total)
        kind = i % 4
        if task is not None and kind in (0, 1):  # task inputs at every difficulty level
            levels = [int(x) for x in rng.integers(0, len(task.levels), size=B)]
            b = task.sample(B, rng, levels=levels)
            ids, mask = b.input_ids.numpy(), b.attention_mask.numpy()
        else:  # random tokens: lengths from 1 to the maximum, padded rows
            T = int(rng.choice([1, 2, 7, 33, 64, cfg.max_len, int(rng.integers(1, cfg.max_len + 1))]))
            ids = rng.integers(1, cfg.vocab_size, size=(B, T)).astype(np.int64)
            lengths = rng.integers(1, T + 1, size=B)
            lengths[0] = T
            mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
            ids = np.where(mask == 1, ids, cfg.pad_id)
        if task is not None and ids.shape[1] > cfg.max_len:
            ids, mask = ids[:, : cfg.max_len], mask[:, : cfg.max_len]
        feeds.append({"input_ids": np.ascontiguousarray(ids), "attention_mask": np.ascontiguousarray(mask)})
        total += B
        i += 1
    return feeds


def _k_margin(s: np.ndarray, H: int) -> np.ndarray:
    sh = s.astype(np.float64) * H
    return np.abs(sh - np.round(sh))


def _mask_margin(p: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Gap between the k-th and (k+1)-th largest preference per row (inf when k = H)."""
    srt = -np.sort(-p.astype(np.float64), axis=-1)
    H = p.shape[-1]
    kk = np.clip(k, 1, H)
    kth = srt[np.arange(len(p)), kk - 1]
    nxt = np.where(kk < H, srt[np.arange(len(p)), np.minimum(kk, H - 1)], -np.inf)
    return kth - nxt


def _top_k_mask(p: np.ndarray, k: np.ndarray) -> np.ndarray:
    """(B, H) mask of the k largest preferences per row, ties to the lower index."""
    order = np.argsort(-p.astype(np.float64), axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(p.shape[-1])[None, :].repeat(len(p), 0), axis=-1)
    return ranks < k[:, None]


def check(artifact_runner: Runner, reference: TorchRunner, *, samples: int = 200, task: str | None = None,
          precision: str = "fp32", seed: int = 0, artifact_name: str = "") -> ParityReport:
    cfg = reference.model.cfg
    if cfg.family == "elastic":
        return check_elastic(artifact_runner, reference, samples=samples, precision=precision, seed=seed,
                             artifact_name=artifact_name)
    if cfg.family in ("tsa", "elastic_decoder"):
        return check_decoder(artifact_runner, reference, samples=samples, task=task, precision=precision,
                             seed=seed, artifact_name=artifact_name)
    tol, margins = TOLERANCES[precision], MARGINS[precision]
    report = ParityReport(artifact_name, artifact_runner.name, precision, tol, margins)
    if "MIL reference" in artifact_runner.name:
        report.note = ("the saved ML program evaluated op by op in numpy (MIL reference evaluation), "
                       "not the Core ML runtime")
    H = cfg.num_heads
    layers = cfg.num_layers if cfg.adaptive else 0
    for bi, feeds in enumerate(parity_inputs(cfg, task, samples, seed)):
        B, T = feeds["input_ids"].shape
        where = f"batch {bi} (B={B}, T={T})"
        specs = artifact_runner.input_metadata()  # e.g. Core ML takes int32 ids: same values, its dtype
        got = artifact_runner.infer({n: a.astype(specs[n].dtype) for n, a in feeds.items()})
        ref, ps = reference.run_with_routing(feeds)
        report.samples += B
        report.batches += 1
        bad_rows = np.zeros(B, dtype=bool)
        forced: list = [None] * layers
        for li in range(layers):
            pre = f"decisions.layer{li}"
            k_ref, k_got = ref[f"{pre}.k"], got[f"{pre}.k"]
            m_ref, m_got = ref[f"{pre}.head_mask"], got[f"{pre}.head_mask"]
            k_flip = k_ref != k_got
            k_margin = _k_margin(ref[f"{pre}.s"], H)
            # The head set must be the top k_got of the reference's preferences, whichever k was used:
            # an excused k flip does not excuse a wrong set.
            m_expect = np.where(k_flip[:, None], _top_k_mask(ps[li], k_got), m_ref)
            m_flip = (m_expect != m_got).any(-1)
            m_margin = _mask_margin(ps[li], k_got)
            checks = ((f"{pre}.k", k_flip, k_margin, margins["k"], "|s*H - round(s*H)|"),
                      (f"{pre}.head_mask", m_flip, m_margin, margins["head_mask"], "gap between the k-th and (k+1)-th p"))
            excused_any = False
            for name, flip, margin, limit, what in checks:
                ok = margin < limit
                st = report.decisions.setdefault(name, DecisionStat())
                st.count(flip, ok)
                excused_any |= bool((flip & ok).any())
                for row in np.flatnonzero(flip & ~ok):
                    bad_rows[row] = True
                    report.failures.append(
                        f"{name}: unexcused flip at {where} row {row}: reference {ref[name][row].tolist()} vs "
                        f"artifact {got[name][row].tolist()}; the reference's {what} was {margin[row]:.2e}, "
                        f"a margin of {margin[row]:.2e} would excuse it (stated margin {limit:g})")
            for kv in k_got.tolist():
                report.decisions[f"{pre}.k"].values_seen[kv] = report.decisions[f"{pre}.k"].values_seen.get(kv, 0) + 1
            if excused_any:
                # replay the artifact's routing up to this layer, so later layers and the values are
                # compared on the inputs the artifact actually saw
                forced[li] = m_got.astype(bool)
                ref, ps = reference.run_with_routing(feeds, force_masks=forced)
        for name in ref:
            if name.endswith(".k") or name.endswith(".head_mask"):
                continue
            a, r = got[name].astype(np.float64), ref[name].astype(np.float64)
            keep = ~bad_rows  # rows with an unexcused flip already failed; their values mean nothing
            a, r = a[keep], r[keep]
            _compare_values(report, name, a, r, where)
    return report


def _compare_values(report: ParityReport, name: str, a: np.ndarray, r: np.ndarray, where: str) -> None:
    """Fold one output's artifact values `a` against the reference `r` into the report."""
    tol = report.tolerance
    st = report.outputs.setdefault(name, OutputStat())
    if a.size == 0:
        return
    err = np.abs(a - r)
    need = float(np.max(err - tol["rtol"] * np.abs(r)))
    if err.max() > st.max_abs_err:
        st.max_abs_err, st.worst_input = float(err.max()), where
    st.max_rel_err = max(st.max_rel_err, float((err / np.maximum(np.abs(r), 1e-12)).max()))
    st.needed_atol = max(st.needed_atol, need)
    if need > tol["atol"]:
        report.failures.append(f"{name}: error {err.max():.3e} at {where} exceeds atol={tol['atol']:g} "
                               f"rtol={tol['rtol']:g}; the smallest atol that passes is {need:.3e}")


# --- decoders (TSA): prefill then decode steps, each step checked on the reference's own cache ---

def decoder_parity_inputs(cfg, task_name: str | None, samples: int, seed: int = 0) -> list[dict]:
    """Sequences totalling `samples`, each with a prefill length and a number of decode steps.

    Task text where the task can make it (copy, sort, the character LM), random tokens otherwise;
    some batches left-padded; prefill lengths from 1 token to the whole sequence."""
    from adaptex.graphs.lm_tasks import get_lm_task

    rng = np.random.default_rng(seed)
    try:
        task = get_lm_task(task_name) if task_name else None
    except Exception:
        task = None
    # an elastic decoder's positions reach far (4096) but parity needs lengths past its window, not
    # quadratic full-attention references at the bound: its sequences stop at 600 tokens
    long_text = cfg.family == "elastic_decoder" and getattr(task, "val", None) is not None
    cap = min(cfg.max_len, 600) if cfg.family == "elastic_decoder" else cfg.max_len
    out, total, i = [], 0, 0
    while total < samples:
        B = min([1, 2, 4, 8][i % 4], samples - total)
        if task is not None and i % 3 != 2:
            ids = task.sample(B, rng).input_ids.numpy()[:, : cfg.max_len]
            if long_text and i % 3 == 1:  # past the streaming window: held-out windows of up to `cap` chars
                N = int(rng.choice([100, 300, cap]))
                starts = rng.integers(0, len(task.val) - N, size=B)
                ids = np.stack([task.val[s:s + N] for s in starts]).astype(np.int64)
        else:
            N = int(rng.choice([2, 9, min(33, cap), cap, int(rng.integers(2, cap + 1))]))
            ids = rng.integers(1, cfg.vocab_size, size=(B, N)).astype(np.int64)
        N = ids.shape[1]
        mask = np.ones_like(ids)
        if i % 4 == 3 and N > 2:  # left padding: rows start late
            pad = rng.integers(0, N // 2, size=B)
            pad[0] = 0
            mask = (np.arange(N)[None, :] >= pad[:, None]).astype(np.int64)
            ids = np.where(mask == 1, ids, cfg.pad_id)
        steps = int(min(N - 1, rng.choice([0, 1, 3, 8])))
        out.append({"input_ids": np.ascontiguousarray(ids), "attention_mask": mask, "prefill": N - steps})
        total += B
        i += 1
    return out


def _decoder_steps(item: dict, cfg):
    """(feeds without past, past length) for the prefill and each decode step of one parity item."""
    ids, mask, T0 = item["input_ids"], item["attention_mask"], item["prefill"]
    yield {"input_ids": ids[:, :T0], "attention_mask": mask[:, :T0]}, 0
    for t in range(T0, ids.shape[1]):
        yield {"input_ids": ids[:, t: t + 1], "attention_mask": mask[:, : t + 1]}, t


def check_decoder(artifact_runner: Runner, reference: TorchRunner, *, samples: int = 200, task: str | None = None,
                  precision: str = "fp32", seed: int = 0, artifact_name: str = "") -> ParityReport:
    """Prefill and decode steps; each step gets the reference's cache (and, for an elastic decoder,
    the reference's prefill head modes), so errors do not compound and every flip is attributed to
    the step that made it. TSA keep flips are excused within |p - 0.5| < margin; elastic head-mode
    flips within the FA/SA logit gap, at prefill only (decode steps take the modes as inputs)."""
    cfg = reference.model.cfg
    elastic = cfg.family == "elastic_decoder"
    tol, margins = TOLERANCES[precision], MARGINS[precision]
    report = ParityReport(artifact_name, artifact_runner.name, precision, tol,
                          {"sa": margins["sa"]} if elastic else {"keep": margins["keep"]})
    if "MIL reference" in artifact_runner.name:
        report.note = ("the saved ML program evaluated op by op in numpy (MIL reference evaluation), "
                       "not the Core ML runtime")
    L, H, dh = cfg.num_layers, cfg.num_heads, cfg.d_model // cfg.num_heads
    specs = artifact_runner.input_metadata()
    for bi, item in enumerate(decoder_parity_inputs(cfg, task, samples, seed)):
        B = item["input_ids"].shape[0]
        report.samples += B
        past = {f"past_key_values.{i}.{kv}": np.zeros((B, H, 0, dh), np.float32) for i in range(L) for kv in ("key", "value")}
        modes = {f"head_modes.{i}": np.zeros((B, H), bool) for i in range(L)} if elastic else {}
        for si, (feeds, P) in enumerate(_decoder_steps(item, cfg)):
            feeds = {**feeds, **past, **modes}
            where = f"batch {bi} step {si} (B={B}, past={P}, new={feeds['input_ids'].shape[1]})"
            report.batches += 1
            got = artifact_runner.infer({n: a.astype(specs[n].dtype) for n, a in feeds.items()})
            real = feeds["attention_mask"][:, P:].astype(bool)  # (B, T): decisions of padding tokens do not count
            decide = _head_mode_decisions if elastic else _keep_decisions
            ref, bad = decide(report, reference, feeds, got, margins, where, P, real)
            for name in ref:
                if name.endswith((".keep", ".sa")):
                    continue
                a, r = got[name].astype(np.float64), ref[name].astype(np.float64)
                keep_rows = ~bad
                a, r = a[keep_rows], r[keep_rows]
                if name.endswith(".p") or name == "logits":  # padding tokens' values mean nothing
                    m = real[keep_rows]
                    a, r = a[m], r[m]
                elif elastic and name.startswith("present."):  # nor do padded positions' cache entries
                    m = feeds["attention_mask"].astype(bool)[keep_rows]
                    a, r = a.transpose(0, 2, 1, 3)[m], r.transpose(0, 2, 1, 3)[m]
                _compare_values(report, name, a, r, where)
            past = {f"past_key_values.{i}.{kv}": ref[f"present.{i}.{kv}"] for i in range(L) for kv in ("key", "value")}
            if elastic and P == 0:  # decode steps reuse the prefill's head modes
                modes = {f"head_modes.{i}": ref[f"decisions.layer{i}.sa"] for i in range(L)}
    return report


def _keep_decisions(report, reference, feeds, got, margins, where, P, real):
    """TSA: each router's per-token keep decision; returns the reference outputs (the artifact's
    routing replayed from an excused flip on) and the rows with an unexcused flip."""
    cfg = reference.model.cfg
    ref, ps = reference.run_with_routing(feeds)
    bad = np.zeros(real.shape[0], dtype=bool)
    routers = cfg.num_layers - 1 if cfg.adaptive else 0
    forced: list = [None] * routers
    for li in range(routers):
        name = f"decisions.layer{li + 1}.keep"
        k_ref, k_got = ref[name].astype(bool), got[name].astype(bool)
        flip = (k_ref != k_got) & real
        margin = np.abs(ps[li].astype(np.float64) - 0.5)
        ok = flip & (margin < margins["keep"])
        st = report.decisions.setdefault(name, DecisionStat())
        st.count(flip, ok, real)
        for v in (0, 1):
            st.values_seen[v] = st.values_seen.get(v, 0) + int(((k_got == bool(v)) & real).sum())
        for row, col in zip(*np.nonzero(flip & ~ok)):
            bad[row] = True
            report.failures.append(
                f"{name}: unexcused flip at {where} row {row} token {col}: reference keep={bool(k_ref[row, col])} "
                f"vs artifact {bool(k_got[row, col])}; the reference's |p - 0.5| was {margin[row, col]:.2e} "
                f"(stated margin {margins['keep']:g})")
        if ok.any():  # replay the artifact's routing from this router on
            forced[li] = k_got
            ref, ps = reference.run_with_routing(feeds, force_masks=forced)
    return ref, bad


def _head_mode_decisions(report, reference, feeds, got, margins, where, P, real):
    """Elastic encoders and decoders: each layer's (B, H) head modes. At prefill (P = 0; an encoder's
    only pass) a flip is excused within the FA/SA logit gap; at a decode step the modes are the
    step's inputs, so any flip fails. Returns the reference outputs (the artifact's modes replayed
    from an excused flip on) and the rows with an unexcused flip."""
    L = reference.model.cfg.num_layers
    ref, gaps = reference.run_with_routing(feeds)
    bad = np.zeros(real.shape[0], dtype=bool)
    forced: list = [None] * L
    for li in range(L):
        name = f"decisions.layer{li}.sa"
        flip = ref[name] != got[name]
        ok = (gaps[li] < margins["sa"]) if P == 0 else np.zeros_like(flip)
        st = report.decisions.setdefault(name, DecisionStat())
        st.count(flip, ok)
        for row, head in zip(*np.nonzero(flip & ~ok)):
            bad[row] = True
            gap = gaps[li][row, head]
            why = (f"the FA/SA logit gap was {gap:.2e}; a margin of {gap:.2e} would excuse it (stated margin "
                   f"{margins['sa']:g})" if P == 0 else "a decode step must pass its head_modes input through")
            report.failures.append(f"{name}: unexcused flip at {where} row {row} head {head}: reference "
                                   f"SA={bool(ref[name][row, head])}, {why}")
        _count_modes(st, got[name])
        if (flip & ok).any():
            forced[li] = got[name].astype(bool)
            ref, gaps = reference.run_with_routing(feeds, force_masks=forced)
    return ref, bad


def _count_modes(st: DecisionStat, sa: np.ndarray) -> None:
    n = int(sa.sum())
    st.values_seen["SA"] = st.values_seen.get("SA", 0) + n
    st.values_seen["FA"] = st.values_seen.get("FA", 0) + sa.size - n


# --- Elastic Attention: head modes first (margin: the FA/SA logit gap), then the embedding ---------

def elastic_parity_inputs(cfg, samples: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Held-out and training text at lengths from a few tokens to the position limit, in batches of
    1 to 16 with padded rows, plus random token soup (routers see unusual key statistics). An inline
    (test) backbone has no tokenizer: random tokens of the same lengths, with padded rows."""
    rng = np.random.default_rng(seed)
    lengths = sorted({min(n, cfg.max_len) for n in (8, 32, 64, 128, 256, cfg.max_len)})
    text = tok = None
    if cfg.backbone == "minilm":
        from adaptex.graphs.elastic import StdlibText
        from adaptex.graphs.minilm import MiniLMTokenizer, default_model_dir

        tok = MiniLMTokenizer(default_model_dir() / "tokenizer.json", max_positions=cfg.max_len)
        text = StdlibText()
    out, n, i = [], 0, 0
    while n < samples:
        B = int(min(samples - n, [1, 4, 16, 7][i % 4]))
        max_len = lengths[i % len(lengths)]
        if tok is None or i % 5 == 4:  # token soup
            ids = rng.integers(1, cfg.vocab_size, size=(B, max_len)).astype(np.int64)
            mask = np.ones_like(ids)
            if B > 1:  # padded rows of random lengths
                for row in range(1, B, 2):
                    mask[row, rng.integers(1, max_len + 1):] = 0
            ids = ids * mask
        else:
            ids_t, mask_t = tok.encode(text.sample(B, rng, split="val" if i % 2 else "train", join=4), max_length=max_len)
            ids, mask = ids_t.numpy(), mask_t.numpy()
        out.append({"input_ids": ids, "attention_mask": mask})
        n, i = n + B, i + 1
    return out


def check_elastic(artifact_runner: Runner, reference: TorchRunner, *, samples: int = 200, precision: str = "fp32",
                  seed: int = 0, artifact_name: str = "") -> ParityReport:
    cfg = reference.model.cfg
    tol, margins = TOLERANCES[precision], MARGINS[precision]
    report = ParityReport(artifact_name, artifact_runner.name, precision, tol, {"sa": margins["sa"]})
    for bi, feeds in enumerate(elastic_parity_inputs(cfg, samples, seed)):
        B, T = feeds["input_ids"].shape
        where = f"batch {bi} (B={B}, T={T})"
        specs = artifact_runner.input_metadata()
        got = artifact_runner.infer({n: a.astype(specs[n].dtype) for n, a in feeds.items()})
        report.samples += B
        report.batches += 1
        ref, bad_rows = _head_mode_decisions(report, reference, feeds, got, margins, where, 0, np.ones((B, 1), bool))
        for name in ref:
            if name.endswith(".sa"):
                continue
            keep = ~bad_rows
            _compare_values(report, name, got[name].astype(np.float64)[keep], ref[name].astype(np.float64)[keep], where)
    return report
