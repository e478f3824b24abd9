"""The ModelRunner owns every tensor (weights, KV pages, buffers) and runs one SchedulerOutput.

One step:  update request states from the diffs -> flatten chunks into a batch -> target forward ->
sample / verify drafts -> MTP pass (catch up its cache on the rows whose next token is now known,
then propose drafts) -> RunnerOutput.
"""

from __future__ import annotations

import dataclasses

import torch

from engine import envs
from engine.attention import get_attention_backend
from engine.config.engine import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SampledOutput, ScheduledChunk, SchedulerOutput
from engine.kv.budget import num_kv_blocks
from engine.kv.cache import KVCacheSpec, PagedKVCache
from engine.kv.offload import KVCopy
from engine.kv.offload_buffer import OffloadBuffer
from engine.loading.loader import build_model, dummy_init, use_kernel_moe
from engine.model.context import ForwardContext
from engine.model.layers import rope_cos_sin, rope_inv_freq
from engine.runner.device_step import DeviceDecode
from engine.runner.inputs import BatchRows, build_batch, chunk_rows, device_index, rows_layout, slots_for
from engine.runner.mtp import MTPProposer
from engine.runner.sampler import RowSpec, Sampler, top_logprobs
from engine.runner.spec import SyntheticAcceptance, verify_drafts
from engine.runner.state import RunnerRequest
from engine.runner.static_decode import StaticDecode
from engine.runner.step_output import LastStep, StepHandle, host_last_step
from engine.runner.structured import StructuredOutputs


class ModelRunner:
    def __init__(self, cfg: EngineConfig, num_blocks: int | None = None, model=None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu":
            torch.set_num_threads(envs.cpu_threads())
        self.block_size = cfg.cache.block_size
        self.with_mtp = cfg.with_mtp
        self.model = model if model is not None else build_model(
            cfg.model, device=self.device, dtype=cfg.torch_dtype, with_mtp=self.with_mtp, checkpoint=cfg.checkpoint)
        if model is None and cfg.checkpoint is None:
            dummy_init(self.model, cfg.seed)
        self.spec = KVCacheSpec.from_model(cfg.model, block_size=self.block_size,
                                           kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                           indexer_precision=cfg.cache.indexer_precision, with_mtp=self.with_mtp)
        num_blocks = num_blocks or num_kv_blocks(cfg, self.spec)
        self.hisparse = None  # HiSparse: host pool + device pages + hot buffers behind a backend wrapper
        if cfg.hisparse is not None:
            from engine.hisparse import HiSparseManager

            self.hisparse = HiSparseManager(cfg, self.spec, self.device, num_blocks)
            self.kv_cache = self.hisparse.cache
        else:
            self.kv_cache = PagedKVCache(self.spec, num_blocks, self.device)
        # --kv-offloading-size: host copies of evicted prefix blocks (the KV manager decides every copy)
        self.kv_offload = OffloadBuffer.for_cache(cfg, self.kv_cache)
        self.backend = self.make_attention_backend()
        self.inv_freq = rope_inv_freq(cfg.model.qk_rope_head_dim, cfg.model.rope_theta, self.device)
        self.sampler = Sampler(self.device, cfg.seed)
        self.states: dict[str, RunnerRequest] = {}
        self.eos_ids = cfg.model.eos_token_ids
        spec_cfg = cfg.speculative
        self.synthetic = (SyntheticAcceptance(spec_cfg.synthetic_acceptance_length, spec_cfg.num_speculative_tokens,
                                              cfg.seed) if spec_cfg and spec_cfg.synthetic_acceptance_length else None)
        self.mtp = MTPProposer(self) if self.with_mtp else None
        self.structured = StructuredOutputs(cfg)  # grammar matchers of constrained requests
        self.slot_fn = self.write_slot_fn()
        self.static = StaticDecode(self) if self.static_decode and cfg.graphs.use_static_path(cfg.device) else None
        if self.static is not None:
            self.static.capture_all()  # CUDA graphs of every bucket, before the first request
        # decode steps with no host sync, from the static buffers (engine/runner/device_step.py)
        self.device_decode = DeviceDecode(self) if self.static is not None else None
        self.last: LastStep | None = None  # where the last step's sampled requests continue (placeholders)
        self.num_host_placeholders = 0  # placeholder chunks filled in from the last step's host copy
        self.num_placeholder_waits = 0  # ... of those, steps that had to wait for it (a GPU still running it)

    # ---- what subclasses specialise (built once, never swapped) ----------------------------------
    static_decode = True  # decode forwards padded to capture sizes from static buffers (CUDA graphs on CUDA)

    def make_attention_backend(self):
        """The attention backend stack of this runner (engine.attention.base.AttentionBackend)."""
        backend = get_attention_backend(self.spec, self.device, self.cfg.attention_backend)
        use_kernel_moe(self.model, backend.name == "triton")  # one switch for every kernel
        if self.hisparse is not None:
            backend = self.hisparse.wrap(backend)
        return backend

    def write_slot_fn(self):
        """(block ids, positions, block size) -> write slots; context parallelism maps to rank-local ones."""
        return slots_for

    # ---- forward helpers -----------------------------------------------------------------------
    def make_context(self, meta, rope_offset: int = 0) -> ForwardContext:
        self.backend.begin_forward(meta)
        cos, sin = rope_cos_sin(meta.positions + rope_offset, self.inv_freq)
        return ForwardContext(meta, self.kv_cache, self.backend, cos, sin)

    def forward(self, rows) -> tuple[torch.Tensor, BatchRows, object]:
        batch = self.static.prepare(rows) if self.static is not None else None
        if batch is not None:
            return self.static.run("target", batch), rows_layout(rows), None
        input_ids, meta, layout = build_batch(rows, self.block_size, self.device, self.slot_fn)
        ctx = self.make_context(meta)
        with torch.inference_mode():
            hidden = self.model(input_ids, ctx)
        return hidden, layout, ctx

    def mtp_forward(self, rows, prev_hidden: torch.Tensor, keep: list[int] | None = None,
                    input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The MTP layer over `rows` (one prev_hidden row per token) -> its output rows (only `keep`'s
        when given: context parallelism then gathers just those). `input_ids` (device, one per row)
        replaces the rows' host token ids: the drafts stay on the device between draft steps."""
        batch = self.static.prepare(rows) if self.static is not None else None
        if batch is not None:
            if input_ids is not None:
                batch.input_ids.index_copy_(0, batch.real_idx, input_ids.to(batch.input_ids.dtype))
            out = self.static.run("mtp", batch, prev_hidden)
        else:
            ids, meta, _ = build_batch(rows, self.block_size, self.device, self.slot_fn)
            ctx = self.make_context(meta)
            with torch.inference_mode():
                out = self.model.mtp_forward(ids if input_ids is None else input_ids.to(ids.dtype), prev_hidden, ctx)
        return out if keep is None else out[device_index(keep, out.device)]

    # ---- one step ------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(sched).get()

    def execute_async(self, sched: SchedulerOutput) -> StepHandle:
        """Launch the step; its RunnerOutput is the handle's get(). A decode step of the device path reads
        nothing back while it runs: get() waits for its one copy (docs/async_scheduling.md)."""
        self._update_states(sched)
        last, self.last = self.last, None
        dd = self.device_decode if self.static is not None else None  # benchmarks switch the static path off
        device = dd is not None and dd.eligible(sched.chunks)
        on_device = last is not None and last.on_device
        if any(c.placeholder for c in sched.chunks) and not (device and on_device and self.hisparse is None):
            sched = self._fill_placeholders(sched, last)  # HiSparse places pages by exact starts
        if self.hisparse is not None:
            self.hisparse.begin_step(sched, self.states)
        if device:
            handle, self.last = self.device_decode.run(sched.chunks, last)
            return handle
        out = self._execute_host(sched)
        self.last = host_last_step(sched.chunks, out)
        return StepHandle(out)

    def _fill_placeholders(self, sched: SchedulerOutput, last: LastStep) -> SchedulerOutput:
        """Placeholder chunks -> their tokens and start, read from the last step (waiting for it on a GPU)."""
        if last is None:
            raise RuntimeError("placeholder chunks need the step before them: only the step right after a "
                               "request's sampling step may use them")
        if not last.handle.ready:
            self.num_placeholder_waits += 1
        chunks = []
        for c in sched.chunks:
            if c.placeholder:
                self.num_host_placeholders += 1
                start, ids = last.host(c.req_id)
                c = dataclasses.replace(c, start=start, token_ids=ids[: len(c.token_ids)], placeholder=False)
            chunks.append(c)
        return dataclasses.replace(sched, chunks=chunks)

    def _execute_host(self, sched: SchedulerOutput) -> RunnerOutput:
        """The step with its sampling on the host (any request, any batch)."""
        out = RunnerOutput()
        if sched.is_empty:
            return out
        hidden, layout, _ = self.forward(chunk_rows(sched.chunks, self.states))
        emitted: dict[str, list[int]] = {}
        for chunk, start in zip(sched.chunks, layout.row_starts):
            state = self.states[chunk.req_id]
            if state.return_prompt_logits:
                n_known = len(chunk.token_ids) - chunk.num_draft_tokens
                with torch.inference_mode():
                    out.prompt_logits[chunk.req_id] = self.model.compute_logits(hidden[start:start + n_known]).cpu()
        self._sample(sched.chunks, layout, hidden, out, emitted)
        if self.mtp is not None:
            out.drafts = self.mtp.run(sched.chunks, layout, hidden, emitted)
        return out

    def apply_kv_copies(self, copies: list[KVCopy]) -> None:
        """Offload copies decided outside a step (EngineCore.flush_kv_copies), done when this returns."""
        self.kv_offload.apply(copies, wait=True)

    def _update_states(self, sched: SchedulerOutput) -> None:
        if sched.kv_copies:  # first: this step's forward (and HiSparse's page placement) reads those blocks
            self.kv_offload.apply(sched.kv_copies)
        for rid in sched.finished_req_ids + sched.preempted_req_ids:
            self.states.pop(rid, None)
        for d in sched.new_requests:
            self.states[d.req_id] = RunnerRequest.from_new(d, self.device)
            self.structured.attach(self.states[d.req_id])
        for c in sched.chunks:
            if c.new_block_ids:
                self.states[c.req_id].block_ids.extend(c.new_block_ids)

    def _sample(self, chunks: list[ScheduledChunk], layout: BatchRows, hidden: torch.Tensor, out: RunnerOutput,
                emitted: dict[str, list[int]]) -> None:
        todo = [(c, s) for c, s in zip(chunks, layout.row_starts) if c.sample]
        if not todo:
            return
        row_idx = []
        for c, s in todo:
            last_known = s + len(c.token_ids) - c.num_draft_tokens - 1
            row_idx.extend(range(last_known, last_known + c.num_draft_tokens + 1))
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[device_index(row_idx, hidden.device)])
        valid = self.structured.mask([c for c, _ in todo], self.states, logits)  # in place, before sampling
        greedy = self._plain_greedy(todo, logits, row_idx)
        r = 0
        for c, _ in todo:
            st = self.states[c.req_id]
            if c.req_id in greedy:
                res = SampledOutput(token_ids=[greedy[c.req_id]])
                r += 1
            else:
                n = c.num_draft_tokens + 1
                res = self._sample_one(c, logits[r:r + n], valid.get(c.req_id))
                r += n
            self.structured.accept(st, res)  # may end the step's tokens at the grammar's stop token
            out.sampled[c.req_id] = res
            emitted[c.req_id] = res.token_ids
            st.output_token_ids.extend(res.token_ids)

    def _plain_greedy(self, todo, logits: torch.Tensor, row_idx: list[int]) -> dict[str, int]:
        """One batched argmax for greedy rows with no drafts, penalties, logprobs or min_tokens."""
        rows, ids = [], []
        r = 0
        for c, _ in todo:
            p = self.states[c.req_id].sampling_params
            if (p.greedy and not c.num_draft_tokens and not p.needs_penalties and p.logprobs is None
                    and p.min_tokens == 0):
                rows.append(r)
                ids.append(c.req_id)
            r += c.num_draft_tokens + 1
        if not rows:
            return {}
        tokens = logits[device_index(rows, logits.device)].argmax(dim=-1)
        return dict(zip(ids, tokens.tolist()))  # the step's read of its sampled tokens

    def _sample_one(self, c: ScheduledChunk, logits: torch.Tensor, valid_drafts: int | None = None) -> SampledOutput:
        """valid_drafts: with a grammar, how many drafts it accepts (the rows are masked already)."""
        st = self.states[c.req_id]
        p = st.sampling_params
        drafts = c.token_ids[len(c.token_ids) - c.num_draft_tokens:] if c.num_draft_tokens else []
        rows = [RowSpec(p, st.prompt_token_ids, st.output_token_ids + drafts[:i], st.generator, self.eos_ids,
                        grammar=st.grammar is not None) for i in range(len(drafts) + 1)]
        probs = self.sampler.probs(logits, rows)
        if self.synthetic is not None and drafts:
            n_acc = min(self.synthetic.num_accepted(len(drafts)), len(drafts) if valid_drafts is None else valid_drafts)
            bonus = int(self.sampler.draw(probs[n_acc:n_acc + 1], [st.generator])[0])
            tokens = drafts[:n_acc] + [bonus]
        elif drafts:
            tokens, n_acc = verify_drafts(self.sampler, probs, drafts, st.draft_probs, p.greedy, st.generator)
        else:
            tokens, n_acc = [int(self.sampler.draw(probs, [st.generator])[0])], 0
        lps = None
        if p.logprobs is not None:
            used = logits[: len(tokens)]
            lps = top_logprobs(used, torch.tensor(tokens), [p.logprobs] * len(tokens))
        return SampledOutput(token_ids=tokens, logprobs=lps, num_drafts=len(drafts), num_accepted=n_acc)
