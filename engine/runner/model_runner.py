"""The ModelRunner owns every tensor (weights, KV pages, buffers) and runs one SchedulerOutput.

One step:  update request states from the diffs -> flatten chunks into a batch -> target forward ->
sample / verify drafts -> MTP pass (catch up its cache on the rows whose next token is now known,
then propose drafts) -> RunnerOutput.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

import torch

from engine import settings
from engine.attention import get_attention_backend
from engine.config.engine import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SampledOutput, ScheduledChunk, SchedulerOutput
from engine.hisparse import HiSparseManager
from engine.kv.budget import num_kv_blocks
from engine.kv.cache import KVCacheSpec, PagedKVCache
from engine.kv.offload import KVCopy
from engine.kv.offload_buffer import OffloadBuffer
from engine.loading.loader import build_model, dummy_init, use_kernels
from engine.loading.weight_stats import rank_weight_report
from engine.model.context import ForwardContext
from engine.model.layers import rope_cos_sin, rope_inv_freq
from engine.model.projections import pack_projections
from engine.runner.device_step import DeviceDecode
from engine.runner.inputs import BatchRows, build_batch, chunk_rows, device_index, rows_layout, slots_for
from engine.runner.mtp import MTPProposer
from engine.runner.sampler import RowParams, RowSpec, Sampler, sampled_order, top_logprobs
from engine.runner.speculative import StepRows, SyntheticAcceptance, draft_dists, verify
from engine.runner.state import RunnerRequest
from engine.runner.static_decode import StaticDecode
from engine.runner.step_output import LastStep, StepHandle, host_last_step
from engine.runner.structured import StructuredOutputs


class ModelRunner:
    def __init__(self, cfg: EngineConfig, num_blocks: int | None = None, model=None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu":
            torch.set_num_threads(settings.cpu_threads())
        self.block_size = cfg.cache.block_size
        self.with_mtp = cfg.with_mtp
        self.model = model if model is not None else build_model(
            cfg.model, device=self.device, dtype=cfg.torch_dtype, with_mtp=self.with_mtp, checkpoint=cfg.checkpoint)
        if model is None and cfg.checkpoint is None:
            dummy_init(self.model, cfg.seed)
        if pack_projections(self.model) and self.device.type == "cuda":
            # the members' own weight tensors were freed: hand their memory back before the KV budget reads it
            torch.cuda.empty_cache()
        self.spec = KVCacheSpec.from_model(cfg.model, block_size=self.block_size,
                                           kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                           indexer_precision=cfg.cache.indexer_precision, with_mtp=self.with_mtp)
        num_blocks = num_blocks or num_kv_blocks(cfg, self.spec)
        self.hisparse = None  # HiSparse: host pool + device pages + hot buffers behind a backend wrapper
        if cfg.hisparse is not None:
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
        if self.device_decode is not None and self.device_decode.step_graphs is not None:
            self.device_decode.step_graphs.capture_all()  # the whole greedy MTP step, per capture size
        self.last: LastStep | None = None  # where the last step's sampled requests continue (placeholders)
        self.num_host_placeholders = 0  # placeholder chunks filled in from the last step's host copy
        self.num_placeholder_waits = 0  # ... of those, steps that had to wait for it (a GPU still running it)

    # ---- what subclasses specialise (built once, never swapped) ----------------------------------
    static_decode = True  # decode forwards padded to capture sizes from static buffers (CUDA graphs on CUDA)

    def make_attention_backend(self):
        """The attention backend stack of this runner (engine.attention.base.AttentionBackend)."""
        backend = get_attention_backend(self.spec, self.device, self.cfg.attention_backend)
        use_kernels(self.model, backend.name == "triton")  # one switch for every kernel
        if self.hisparse is not None:
            backend = self.hisparse.wrap(backend)
        return backend

    def begin_pass(self, kind: str, rows: int | None) -> None:
        """Called before every forward pass: kind "target" or "mtp", its rows (None: an unpadded eager pass), or
        "step" once for a whole-step graph. A DP × EP rank checks it against the group's plan."""

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
        self.begin_pass("target", None)
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
            self.begin_pass("mtp", None)
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

    def weight_report(self) -> dict:
        """This rank's weights: bytes by dtype and what loading read (engine.loading.weight_stats)."""
        return rank_weight_report(self)

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
        """Every sampling chunk's rows (its last known token, then its drafts) in one batch through
        `verify`, the device decode step's own sampling; one read of the tokens."""
        todo = [(c, s) for c, s in zip(chunks, layout.row_starts) if c.sample]
        if not todo:
            return
        row_idx, ids, specs = [], [], []
        for c, s in todo:
            st = self.states[c.req_id]
            n_known = len(c.token_ids) - c.num_draft_tokens
            row_idx.extend(range(s + n_known - 1, s + len(c.token_ids)))
            ids.extend(c.token_ids[n_known - 1:])
            drafts = c.token_ids[n_known:]
            specs.extend(RowSpec(st.sampling_params, st.prompt_token_ids, st.output_token_ids + drafts[:i],
                                 self.eos_ids, grammar=st.grammar is not None)
                         for i in range(len(drafts) + 1))
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[device_index(row_idx, hidden.device)])
        valid = self.structured.mask([c for c, _ in todo], self.states, logits)  # in place, before sampling
        states = [self.states[c.req_id] for c, _ in todo]
        nd = [c.num_draft_tokens for c, _ in todo]
        syn = None
        if self.synthetic is not None:
            syn = [min(self.synthetic.num_accepted(d), valid.get(c.req_id, d)) if d else 0
                   for (c, _), d in zip(todo, nd)]
        with torch.inference_mode():
            x = self.sampler.penalise(logits, specs)
            pos0 = [c.start + len(c.token_ids) - c.num_draft_tokens for c, _ in todo]  # the first token drawn
            n_acc, tokens = verify(self.sampler, x, self._step_rows(states, nd, ids, syn, logits.shape[-1], pos0))
            rows = torch.cat([n_acc[:, None], tokens], dim=1).tolist()  # the step's read of its sampled tokens
        r = 0
        for (c, _), st, n, row in zip(todo, states, nd, rows):
            res = SampledOutput(token_ids=row[1: row[0] + 2], num_drafts=n, num_accepted=row[0])
            if st.sampling_params.logprobs is not None:
                res.logprobs = top_logprobs(logits[r: r + row[0] + 1], torch.tensor(res.token_ids),
                                            [st.sampling_params.logprobs] * len(res.token_ids))
            r += n + 1
            self.structured.accept(st, res)  # may end the step's tokens at the grammar's stop token
            out.sampled[c.req_id] = res
            emitted[c.req_id] = res.token_ids
            st.output_token_ids.extend(res.token_ids)

    def _step_rows(self, states: list[RunnerRequest], nd: list[int], ids: list[int],
                   syn: list[int] | None, V: int, pos0: list[int]) -> StepRows:
        """The host lists of `verify`'s rows -> its device tensors (drafts without their distribution, e.g.
        proposed before a restart of the request's state, count as drawn from a point mass). `pos0`: per
        request, the sequence position of the token its first row draws."""
        params = [st.sampling_params for st in states]
        order = sampled_order(params)
        dists, at = [], 0
        for st, n in zip(states, nd):
            d = st.draft_probs
            if n and not st.sampling_params.greedy and (d is None or d.shape[0] < n):
                d = torch.zeros((n, V), device=self.device)
                d[torch.arange(n), torch.tensor(ids[at + 1: at + 1 + n])] = 1.0
            dists.append(d)
            at += n + 1
        q, q_off = draft_dists(dists, order, nd)
        row_start = list(accumulate([1 + n for n in nd], initial=0))[:-1]
        cols = torch.tensor([*RowParams.encode(params), row_start, nd, q_off, syn or [0] * len(nd), pos0],
                            dtype=torch.int64).to(self.device)
        return StepRows(ids=torch.tensor(ids, dtype=torch.int64).to(self.device), row_start=cols[4], nd=cols[5],
                        nd_host=nd, k=self.cfg.num_spec_tokens if self.mtp is not None else 0,
                        params=RowParams.decode(params, cols[:4]), order=order,
                        order_t=device_index(order, self.device), pos0=cols[8], q=q, q_off=cols[6],
                        syn=cols[7] if syn is not None else None)

