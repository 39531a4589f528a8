"""The contract of a decoder with a KV cache (graphs/family.py): Optimum's decoder-with-past I/O, one
graph for prefill and decode, and parity that walks each sequence through its cache."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from adaptex.graphs.family import PARITY_SCORES_PER_BATCH, Contract


class DecoderContract(Contract):
    """A decoder with a KV cache, in Optimum's decoder-with-past names: inputs input_ids,
    attention_mask, past_key_values.{i}.key/value (plus `extra_inputs`); outputs logits and
    present.{i}.key/value, then the recorded decisions. One graph serves prefill (an empty cache) and
    decode steps. Parity walks each sequence as a prefill and decode steps, each step fed the
    reference's own cache, so errors do not compound and every flip belongs to one step."""

    decoder = True
    coreml_default_precision = "fp32"
    ort_model_type = "gpt2"

    @property
    def heads_dims(self) -> tuple[int, int]:
        return self.cfg.num_heads, self.cfg.d_model // self.cfg.num_heads

    def extra_inputs(self, mode: str = "hard") -> list[str]:
        return []

    def input_names(self, mode: str = "hard") -> list[str]:
        names = ["input_ids", "attention_mask"]
        for i in range(self.cfg.num_layers):
            names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        return names + self.extra_inputs(mode)

    def model_output_names(self, mode: str = "hard") -> list[str]:
        names = ["logits"]
        for i in range(self.cfg.num_layers):
            names += [f"present.{i}.key", f"present.{i}.value"]
        return names

    def split_inputs(self, inputs: tuple) -> tuple:
        """(ids, mask, past [(key, value)] per layer, extra inputs)."""
        L = self.cfg.num_layers
        past = [(inputs[2 + 2 * i], inputs[3 + 2 * i]) for i in range(L)]
        return inputs[0], inputs[1], past, list(inputs[2 + 2 * L:])

    def example_inputs(self, mode: str = "hard", step: bool = False) -> tuple:
        """A call of 16 new tokens after 3 cached ones (not 0 or 1: those would specialise); step:
        the decode-step program's, one new token after 3."""
        cfg = self.cfg
        batch, past = 2, 3
        seq = 1 if step else min(16, cfg.max_len - past)
        H, dh = self.heads_dims
        ids = torch.randint(1, cfg.vocab_size, (batch, seq))
        mask = torch.ones(batch, past + seq, dtype=torch.int64)
        cache = [torch.randn(batch, H, past, dh) for _ in range(2 * cfg.num_layers)]
        return (ids, mask, *cache, *self.extra_example(batch, mode))

    def extra_example(self, batch: int, mode: str) -> list[Tensor]:
        return []

    def dynamic_shapes(self, mode: str = "hard", step: bool = False):
        """Every call: any batch, sequence and past (from 0). step: the decode-step program's, one new
        token (a static size) after a past the exporter's dispatch keeps non-empty."""
        batch = torch.export.Dim("batch", min=1, max=4096)
        past = torch.export.Dim("past_sequence", min=0, max=self.cfg.max_len - 1)
        if step:  # the dispatch, not a guard, keeps its calls to a non-empty cache; AUTO: a guard the
            # trace adds on the past that it cannot prove for every size (a grouped-query expand's
            # strides: min(8 (P + 1), 16 (P + 1)) == 8 (P + 1)) is an assumption, not a refusal
            past = torch.export.Dim.AUTO
            shapes = [{0: batch}, {0: batch, 1: past}]
        else:
            seq = torch.export.Dim("sequence", min=1, max=self.cfg.max_len)
            shapes = [{0: batch, 1: seq}, {0: batch, 1: torch.export.Dim.AUTO}]
        shapes += [{0: batch, 2: past} for _ in range(2 * self.cfg.num_layers)]
        shapes += [{0: batch} for _ in self.extra_inputs(mode)]
        return (tuple(shapes),)

    def routing_meta(self) -> dict:
        return {"kv_cache_bound": self.cfg.max_len}

    def axis_names(self, mode: str = "hard") -> dict[str, dict[int, str]]:
        # the mask spans the cached and the new tokens (a sum TensorRT's profile needs; not a free axis)
        return {"attention_mask": {1: "past_sequence + sequence"}}

    # --- parity: prefill, then decode steps on the reference's cache ----------------------------------
    def parity_items(self, task: str | None, samples: int, seed: int = 0) -> list[dict]:
        """Sequences totalling `samples`, each with a prefill length and a number of decode steps.

        Task text where the task can make it (copy, sort, the character LM), random tokens otherwise;
        some batches left-padded; prefill lengths from 1 token to the whole sequence. A long
        sequence's batch keeps only the rows whose attention scores fit PARITY_SCORES_PER_BATCH."""
        from adaptex.graphs.lm_tasks import get_lm_task

        cfg = self.cfg
        rng = np.random.default_rng(seed)
        try:
            task_obj = get_lm_task(task) if task else None
        except Exception:
            task_obj = None
        cap = self.parity_cap()
        long_text = cap < cfg.max_len and getattr(task_obj, "val", None) is not None
        out, total, i = [], 0, 0
        while total < samples:
            B = min([1, 2, 4, 8][i % 4], samples - total)
            if task_obj is not None and i % 3 != 2:
                ids = task_obj.sample(B, rng).input_ids.numpy()[:, : cfg.max_len]
                if long_text and i % 3 == 1:  # past a streaming window: held-out text of up to `cap` chars
                    N = int(rng.choice([100, 300, cap]))
                    starts = rng.integers(0, len(task_obj.val) - N, size=B)
                    ids = np.stack([task_obj.val[s:s + N] for s in starts]).astype(np.int64)
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
            n_steps = int(min(N - 1, rng.choice([0, 1, 3, 8])))
            B = min(B, max(1, PARITY_SCORES_PER_BATCH // (cfg.num_heads * N * N)))  # rows drawn, then cut:
            ids, mask = ids[:B], mask[:B]  # the random stream, so every item before and after, stays as it was
            out.append({"input_ids": np.ascontiguousarray(ids), "attention_mask": mask, "prefill": N - n_steps})
            total += B
            i += 1
        return out

    def parity_cap(self) -> int:
        """The longest parity sequence (a model with positions far past its training context can stop short)."""
        return self.cfg.max_len

    def empty_cache(self, B: int) -> dict[str, np.ndarray]:
        H, dh = self.heads_dims
        return {f"past_key_values.{i}.{kv}": np.zeros((B, H, 0, dh), np.float32)
                for i in range(self.cfg.num_layers) for kv in ("key", "value")}

    def next_extra(self, outputs: dict, P: int, extra: dict) -> dict:
        """The extra inputs of the step after one (past length P) whose outputs are `outputs`."""
        return extra

    def steps(self, item: dict):
        ids, mask, T0 = item["input_ids"], item["attention_mask"], item.get("prefill", item["input_ids"].shape[1])
        B = ids.shape[0]
        past, extra = self.empty_cache(B), self.initial_extra(B)
        spans = [(0, T0)] + [(t, t + 1) for t in range(T0, ids.shape[1])]
        for si, (a, b) in enumerate(spans):
            feeds = {"input_ids": ids[:, a:b], "attention_mask": mask[:, :b], **past, **extra}
            info = {"past": a, "where": f"step {si} (B={B}, past={a}, new={b - a})"}
            ref = yield feeds, info
            past = {f"past_key_values.{i}.{kv}": ref.outputs[f"present.{i}.{kv}"]
                    for i in range(self.cfg.num_layers) for kv in ("key", "value")}
            extra = self.next_extra(ref.outputs, a, extra)

    def initial_extra(self, B: int) -> dict:
        return {}

    def _real_tokens(self, feeds: dict, info: dict) -> np.ndarray:
        return feeds["attention_mask"][:, info["past"]:].astype(bool)  # (B, T) the new tokens that are real

    def decision_region(self, name: str, feeds: dict, info: dict):
        return self._real_tokens(feeds, info) if name.endswith(".keep") else None

    def select(self, name: str, values: np.ndarray, feeds: dict, info: dict, rows: np.ndarray) -> np.ndarray:
        if name == "logits" or name.endswith(".p"):  # padding tokens' values mean nothing
            return values[self._real_tokens(feeds, info)[rows]]
        if name.startswith("present."):  # nor do padded positions' cache entries
            return values.transpose(0, 2, 1, 3)[feeds["attention_mask"].astype(bool)[rows]]
        return values

    # --- bench -------------------------------------------------------------------------------------------
    def bench_feeds(self, task: str | None, batch: int, seq: int, past: int = 0, seed: int = 0) -> dict:
        """Feeds for a step of `seq` new tokens after `past` cached ones; the cache itself is filled by
        a prefill of the preceding text (key "_prefill"), run on the adaptive artifact by the bench."""
        from adaptex.graphs.lm_tasks import get_lm_task

        cfg = self.cfg
        rng = np.random.default_rng(seed)
        n = past + seq
        try:
            task_obj = get_lm_task(task) if task else None
            if getattr(task_obj, "val", None) is not None and len(task_obj.val) > n:  # held-out text windows
                starts = rng.integers(0, len(task_obj.val) - n, size=batch)
                text = np.stack([task_obj.val[s:s + n] for s in starts]).astype(np.int64)
            else:
                text = task_obj.sample(batch, rng).input_ids.numpy() if task_obj is not None else None
        except Exception:
            text = None
        if text is None or text.shape[1] < n:  # random tokens: routing on them says little; prefer a task
            text = rng.integers(1, cfg.vocab_size, size=(batch, n)).astype(np.int64)
        text = text[:, :n]
        empty = {**self.empty_cache(batch), **self.initial_extra(batch)}
        feeds = {"input_ids": np.ascontiguousarray(text[:, past:]), "attention_mask": np.ones((batch, n), np.int64),
                 **empty}
        if past:
            feeds["_prefill"] = {"input_ids": np.ascontiguousarray(text[:, :past]),
                                 "attention_mask": np.ones((batch, past), np.int64), **empty}
        return feeds
