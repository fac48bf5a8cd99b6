"""GPU bytes per pipeline stage: what is live at the stage's peak, by component, and what the
device holds above it.

The peak is found the way the hook measures it (calibration/live_memory.py: live tensor bytes after
every operator): the stage's candidate worst moments are built from the same accounting and the
largest wins --
  * the backward of the top block (the first block a micro-batch's backward reaches), when the
    most micro-batches are in flight: DeepSpeed's 1F1B keeps min(pp - s, gas) on stage s; the
    first backward of an iteration has the most in flight, a later one has every weight gradient;
  * the head's and the loss's backward on the last stage;
  * the gradient reduction and the optimizer step.
Each candidate adds the model states (optimizer_memory.py), the saved tensors of every micro-batch
in flight (activations.py), the recomputed chunk, the pipeline's buffers and the logits its
output slots hold, the backward's temporaries, and what stays from one iteration to the next.

Above the allocated peak, device_memory.py adds what the GPU really holds (allocator reserve,
CUDA context, NCCL buffers): `device_total` is what nvidia-smi shows and what the out-of-memory
verdict compares with the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..config.specs import ModelSpec, ParallelSpec, TrainingSpec
from .activations import (ActivationContext, BackwardPeak, block_backward, block_saved,
                          embedding_saved, final_norm_backward, final_norm_saved, logits_bytes,
                          loss_copy_bytes)
from .device_memory import CHURN, device_terms, usable
from .layers import checkpoint_chunks
from .optimizer_memory import SIXTEEN_BIT, OptimizerLayout, optimizer_layout
from .options import DEFAULT_OPTIONS, DeriveOptions
from .params import mlp_widths

# What is live at a stage's peak, by what each tensor is (the hook measures the same split:
# calibration/live_memory.py). Training state: weights, gradients (param.grad and DeepSpeed's
# gradient buffers), fp32 master weights, optimizer states. Made during the iteration:
# activations (saved by forward passes), recompute (a checkpointed chunk re-run in backward),
# logits (the head's output, the loss's fp32 copy and their gradients), buffers (pipeline
# send/receive and gradient-reduction buffers), temporaries (backward's activation gradients,
# the optimizer step's transients), other (alive across iterations: masks, caches, data).
COMPONENTS = ("weights", "gradients", "master_weights", "optimizer_states", "activations",
              "recompute", "logits", "buffers", "temporaries", "other")
# the stage table's columns (render/check_text): every component in exactly one
COLUMNS = (("weights", ("weights",)), ("grads", ("gradients",)),
           ("optim", ("master_weights", "optimizer_states")),
           ("activ.", ("activations", "recompute")),
           ("logits/buffers", ("logits", "buffers", "temporaries", "other")))


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of a pipeline stage (every TP rank of a stage holds the same amount)."""
    stage: int
    micro_batches_in_flight: int
    optimizer_wrapper: str
    weights: int
    gradients: int  # param.grad plus accumulation / partition buffers, all of them
    master_weights: int  # fp32 master copy (sharded where the wrapper shards it)
    optimizer_states: int
    activations: int  # saved tensors of the stage's layers, all micro-batches in flight
    recompute: int  # one checkpointed chunk's full activations, rebuilt during backward
    embedding: int  # EmbeddingPipe's saved tensors (first stage)
    logits: int  # logits kept by the pipeline's output slots, the loss's fp32 copy (last stage)
    pipe_buffers: int  # received inputs, receive and gradient buffers of the pipeline
    zero_buffers: int  # gradient reduction buckets
    step_transient: int  # extra bytes inside optimizer.step()
    persistent: int  # weights + gradients + master + states
    backward_peak: int  # the largest moment of forward/backward
    step_peak: int  # the largest moment of the gradient reduction / optimizer step
    total: int  # peak allocated bytes: max(backward_peak, step_peak) = sum(peak.values())
    capacity: Optional[int]  # GPU memory given by the caller (the data sheet's)
    headroom: Optional[int]  # usable_capacity - device_total (negative: does not fit)
    # (dicts are left out of the hash: equal stages still compare equal)
    peak: Dict[str, int] = field(default_factory=dict, hash=False)  # COMPONENTS live at the peak
    peak_moment: str = ""  # which moment it is
    device_terms: Dict[str, int] = field(default_factory=dict, hash=False)  # above allocated
    device_total: int = 0  # total + sum(device_terms): what the GPU shows for the process
    usable_capacity: Optional[int] = None  # of capacity, what CUDA lets a process allocate


def columns(mem: "StageMemory") -> Dict[str, int]:
    """The stage table's columns in bytes: every byte of device_total in exactly one."""
    out = {name: sum(mem.peak.get(c, 0) for c in parts) for name, parts in COLUMNS}
    out["device overhead"] = sum(mem.device_terms.values())
    return out


class _Moment:
    def __init__(self, where: str):
        self.where = where
        self.parts: Dict[str, float] = {c: 0.0 for c in COMPONENTS}

    def add(self, component: str, nbytes: float) -> "_Moment":
        self.parts[component] += nbytes
        return self

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def stage_memory(*, stage: int, num_stages: int, layers: Sequence, model: ModelSpec,
                 parallel: ParallelSpec, training: TrainingSpec, padded_vocab: int,
                 stage_params: int, largest_layer_params: int,
                 gpu_memory_bytes: Optional[int] = None,
                 opts: DeriveOptions = DEFAULT_OPTIONS, device: str = "cuda") -> StageMemory:
    """Memory of stage `stage` holding `layers` (its slice of the PipeLayer list). `device`
    "cpu" predicts a CPU run (validation): NeoX's rotary caches then live on the device."""
    st = _Stage(stage, num_stages, layers, model, parallel, training, padded_vocab, stage_params,
                largest_layer_params, opts, device)
    moments = st.moments()
    peak = max(moments, key=lambda m: m.total)
    steps = [m for m in moments if m.where.startswith(_STEP)]
    step = max(steps, key=lambda m: m.total)
    backward = max((m for m in moments if m not in steps), key=lambda m: m.total, default=step)
    r = lambda x: int(round(x))
    parts = {c: r(v) for c, v in peak.parts.items()}
    total = sum(parts.values())
    terms = device_terms(largest_transient=st.largest_transient(),
                         live_tensors=st.live_tensors(),
                         churn=sum(parts[c] for c in CHURN), parallel=parallel, stage=stage,
                         num_stages=num_stages, tied=not model.no_weight_tying, device=device)
    device_total = total + sum(terms.values())
    usable_capacity = None if gpu_memory_bytes is None else usable(gpu_memory_bytes)
    b = backward.parts
    return StageMemory(
        stage=stage, micro_batches_in_flight=st.in_flight, optimizer_wrapper=st.layout.wrapper,
        weights=r(st.weights), gradients=r(st.full_gradients), master_weights=r(st.master),
        optimizer_states=r(st.states), activations=r(b["activations"]),
        recompute=r(b["recompute"]), embedding=r(st.embedding * st.in_flight), logits=r(b["logits"]),
        pipe_buffers=r(st.pipe_buffers()), zero_buffers=r(st.layout.reduce_buffer),
        step_transient=r(st.layout.step_transient * stage_params),
        persistent=r(st.weights + st.full_gradients + st.master + st.states),
        backward_peak=r(backward.total), step_peak=r(step.total), total=total,
        capacity=gpu_memory_bytes,
        headroom=None if usable_capacity is None else usable_capacity - device_total,
        peak=parts, peak_moment=peak.where, device_terms=terms, device_total=device_total,
        usable_capacity=usable_capacity)


_STEP = "optimizer step"


class _Block(NamedTuple):
    """What a block's saved tensors and backward read of its PipeLayer (activations.py): the
    blocks of a model are a few kinds repeated, so each kind is worked out once (an attribute
    activations.py starts to read and this leaves out fails loudly, never silently)."""
    name: str
    attention_type: Optional[str]
    moe: bool


def _kind(layer) -> _Block:
    return _Block(layer.name, layer.attention_type, layer.moe)


# Memoised per (context, kind): a plan derives hundreds of stages of the same few contexts
# (one per micro-batch and tensor parallelism), each with tens of identical blocks.
@lru_cache(maxsize=1024)
def _saved(ctx: ActivationContext, kind: _Block) -> Tuple[float, int]:
    """(bytes, tensors) one micro-batch of a block of this kind keeps until its backward."""
    items = block_saved(ctx, kind)
    return sum(b for _, b in items), len(items)


@lru_cache(maxsize=1024)
def _backward(ctx: ActivationContext, kind: _Block, accumulate: bool, incoming: float,
              transposed: bool) -> BackwardPeak:
    return block_backward(ctx, kind, accumulate, incoming, transposed=transposed)


class _Stage:
    """One stage's tensors, gathered once; `moments()` builds the candidates."""

    def __init__(self, stage, num_stages, layers, model, parallel, training, padded_vocab,
                 stage_params, largest_layer_params, opts, device):
        self.stage, self.num_stages, self.layers = stage, num_stages, list(layers)
        self.model, self.parallel, self.training, self.opts = model, parallel, training, opts
        self.vocab, self.device = padded_vocab, device
        tp = max(parallel.model_parallel_size, 1)
        self.tp = tp
        self.pipelined = parallel.pipe_parallel_size >= 1
        # DeepSpeed's PipelineEngine partitions what a stage sends over the tensor-parallel ranks
        # (is_pipe_partitioned: model parallel and pipeline.pipe_partitioned, True by default;
        # pipe/engine.py): a later stage rebuilds the full activation and stores it in its input
        # slot in place of the received partition, and the forward runs on that tensor itself
        # (no clone); a non-last stage keeps only its output's partition.
        self.pipe_partitioned = self.pipelined and tp > 1 and num_stages > 1
        self.gas = max(training.gradient_accumulation_steps, 1)
        # 1F1B: stage s runs (pp - s) warm-up forwards before its first backward; without a
        # pipeline each micro-batch's backward frees its activations before the next forward.
        self.in_flight = min(num_stages - stage, self.gas) if self.pipelined else 1
        self.layout: OptimizerLayout = optimizer_layout(training, parallel, stage_params,
                                                        largest_layer_params, opts)
        L = self.layout
        self.stage_params = stage_params
        self.weights = L.weight * stage_params + L.weight_working_set
        self.full_gradients = L.gradient * stage_params
        self.master = L.master * stage_params
        self.states = L.states * stage_params
        e = 2 if training.precision in SIXTEEN_BIT else 4
        self.ctx = ActivationContext(
            model=model, micro_batch=training.micro_batch_size, tp=tp,
            seq_div=tp if (parallel.sequence_parallel and tp > 1) else 1, act_bytes=e, opts=opts,
            partition_activations=training.partition_activations, pipelined=self.pipelined,
            precision=training.precision, param_bytes=int(L.weight) or e, device=device)
        self.first = bool(self.layers) and self.layers[0].kind == "embedding"
        self.last = bool(self.layers) and self.layers[-1].kind == "head" and stage == num_stages - 1
        self.blocks = [l for l in self.layers if l.is_block]
        interval = training.checkpoint_num_layers if training.checkpoint_activations else 0
        self.chunks = checkpoint_chunks([l.name for l in self.layers], interval, self.pipelined)
        self.embedding = sum(b for _, b in embedding_saved(self.ctx)) if self.first else 0.0
        # pipeline slots in use: DeepSpeed keeps max(2, min(pp - s, gas)) buffers, filled in turn
        self.slots = min(max(2, min(num_stages - stage, self.gas)), self.gas) if self.pipelined else 1
        # (bytes, tensors) one micro-batch of each block keeps, worked out once per kind
        kinds: Dict[tuple, Tuple[float, int]] = {}
        self._saved: Dict[int, Tuple[float, int]] = {}
        for l in self.blocks:
            k = (l.name, l.attention_type, l.moe)
            hit = kinds.get(k)
            if hit is None:
                hit = kinds[k] = _saved(self.ctx, _Block(*k))
            self._saved[id(l)] = hit  # the stage's own layers, alive as long as it is

    def saved(self, layer) -> Tuple[float, int]:
        """(bytes, tensors) one micro-batch of block `layer` keeps (activations.block_saved)."""
        return self._saved[id(layer)]

    # -- per micro-batch ---------------------------------------------------------------------
    def _rotary_copies(self) -> float:
        """On a GPU each block's forward copies NeoX's CPU-resident cos/sin caches to the device
        (RotaryEmbedding.forward: .to(x.device)); the rotary product keeps them."""
        m = self.model
        if self.device == "cpu" or m.pos_emb != "rotary":
            return 0.0
        return 2 * m.seq_length * m.head_dim * m.rotary_pct * self.ctx.act_bytes

    def _chunk_parts(self) -> Tuple[float, List[Tuple[List, bool]]]:
        """(bytes one micro-batch keeps through the stage's forward, [(chunk blocks, ckpt)])."""
        ctx, kept, out = self.ctx, 0.0, []
        # DeepSpeed's CheckpointFunction keeps each chunk's input and nothing made inside the
        # chunk: the input is the previous chunk's output itself, or a partitioned (tp) / CPU /
        # contiguous copy of it, and then the full output is dropped once the next chunk ran
        copies = (ctx.partition_activations and self.tp > 1) or self.opts.checkpoint_in_cpu \
            or self.opts.contiguous_checkpointing
        chunks = [(start, stop, ckpt) for start, stop, ckpt in self.chunks
                  if any(l.is_block for l in self.layers[start:stop])]
        for i, (start, stop, ckpt) in enumerate(chunks):
            blocks = [l for l in self.layers[start:stop] if l.is_block]
            out.append((blocks, ckpt))
            if ckpt:
                if copies:
                    kept += ctx.checkpoint_input()
                if not copies or i == len(chunks) - 1:
                    kept += ctx.hidden  # the chunk's output, kept by whatever reads it next
            else:
                rot = self._rotary_copies()
                kept += sum(self.saved(l)[0] + rot for l in blocks)
        return kept, out

    def stage_input(self) -> float:
        """What a micro-batch's forward makes before the first block: the embedding's kept
        tensors and _pre_transformer_block's transposed copy (first stage), or the forward's
        clone of the received activation and mask (later stages; pipe-partitioned, the rebuilt
        activation the slot holds)."""
        m, tok = self.model, self.ctx.tokens
        if self.first:
            out = self.embedding + self.ctx.hidden + 8 * tok  # + the token ids embedding keeps
            if m.pos_emb == "learned":
                out += 8 * tok  # the position ids the position embedding keeps
            # the mask: PipelineEngine's forward clones its inputs; NeoX's get_batch makes it
            return out + m.seq_length ** 2
        return self.received() if self.pipelined else 0.0

    def head_items(self) -> float:
        """Final norm (last stage): kept until the head's backward."""
        return sum(b for _, b in final_norm_saved(self.ctx)) if self.last else 0.0

    # -- pipeline buffers ----------------------------------------------------------------------
    def received(self) -> float:
        """One received activation as the pipeline keeps it (its clone) plus the bool mask."""
        return self.ctx.hidden + self.model.seq_length ** 2

    def pipe_buffers(self) -> float:
        """Receive / gradient buffers (persistent: DeepSpeed's _grad_layer_buf, shared by the
        activations a stage receives and the gradients it receives)."""
        if not self.pipelined or self.num_stages == 1:
            return 0.0
        out = self.ctx.hidden  # the received activation or the received gradient
        if self.pipe_partitioned:
            # this rank's partition and PartitionedTensor's int64 meta (ndim, the shape, parts,
            # rank, the tp + 1 offsets)
            out = self.ctx.hidden / self.tp + 8 * (7 + self.tp)
        if self.stage > 0:
            out += 2 * self.model.seq_length ** 2  # the mask, received as half
        return out

    def stage_output(self) -> float:
        """A non-last stage's output kept in the pipe buffers until its backward: with tp > 1
        DeepSpeed keeps only this rank's partition of it."""
        if self.tp > 1 and self.pipelined and not self.last:
            return self.ctx.hidden / self.tp
        return self.ctx.hidden

    def other(self) -> float:
        """Alive across iterations: NeoX's rotary caches when they are on the device (CPU runs),
        and the loaded micro-batches the pipeline slots (or the step) hold."""
        m, tok, s = self.model, self.ctx.tokens, self.model.seq_length
        out = 0.0
        if self.device == "cpu" and m.pos_emb == "rotary":
            # RotaryEmbedding: emb (fp32) and cos/sin in the parameter dtype, per block
            rot = int(m.head_dim * m.rotary_pct)
            out += len(self.blocks) * m.seq_length * rot * (4 + 2 * self.ctx.param_bytes)
        out += self.pipe_module_copy()
        # the iteration's raw micro-batches [b, s + 1] (int64): the dataset's and the
        # broadcast copy of each (mpu.broadcast_data)
        out += 2 * self.gas * 8 * self.training.micro_batch_size * (s + 1)
        if self.pipelined:
            if self.first:
                # the engine's clones of the token and position ids and of the mask
                out += self.slots * (16 * tok + s * s)
            if self.last:
                # NeoX's batch for the slot: token ids, labels (int64), loss mask (fp32), and
                # the position ids' [s] storage when they are not cloned above (measured)
                out += self.slots * (20 * tok + (0 if self.first else 8 * s))
        else:
            out += 20 * tok  # NeoX's get_batch: labels (int64), loss mask (fp32), tokens
        return out

    def no_decay_params(self) -> float:
        """Parameters NeoX puts in its no-weight-decay group (get_params_for_weight_decay_
        optimization): every norm's and every bias, per rank."""
        m, tp = self.model, self.tp
        out, inp = mlp_widths(m)
        norm = m.hidden_size * (2 if m.norm == "layernorm" else 1)
        per_block = 2 * norm
        if m.use_bias_in_attn_linear:
            per_block += (m.num_attention_heads + 2 * m.num_kv_heads) * m.head_dim / tp + m.hidden_size
        if m.use_bias_in_mlp:
            per_block += out / tp + m.hidden_size
        return len(self.blocks) * per_block + (norm if self.last else 0)

    def pipe_module_copy(self) -> float:
        """pp = 0 with tied embeddings: NeoX's to_sequential builds new modules from the specs,
        and the original GPT2ModelPipe stays alive -- the tied head's _logits_helper closes over
        it -- with its own copy of every weight, built on the device unless
        use_cpu_initialization (measured on CPU)."""
        if self.pipelined or self.model.no_weight_tying:
            return 0.0
        if self.device == "cuda" and self.opts.use_cpu_initialization:
            return 0.0
        m, pb = self.model, self.ctx.param_bytes
        # the copy was never cast: torch's LayerNorm and position Embedding are built in fp32,
        # NeoX's own parallel layers in params_dtype
        norms = (2 * len(self.blocks) + 1) * m.hidden_size * (2 if m.norm == "layernorm" else 1)
        positions = m.max_position_embeddings * m.hidden_size if m.pos_emb == "learned" else 0
        return self.stage_params * pb + (4 - pb) * (norms + positions)

    # -- for the device terms -----------------------------------------------------------------
    def largest_transient(self) -> float:
        """The largest tensor the backward makes and frees: a score-sized gradient (unfused
        attention), an MLP-sized one, or the logits' (last stage)."""
        ctx, m = self.ctx, self.model
        out, _ = mlp_widths(m)
        sizes = [ctx.act_bytes * ctx.tokens * out / self.tp, ctx.gathered]
        if any(l.attention_type != "flash" for l in self.blocks):
            sizes.append(ctx.act_bytes * (m.num_attention_heads // self.tp) * m.seq_length ** 2
                         * ctx.micro_batch)
        if self.last:
            sizes.append(logits_bytes(ctx, self.vocab))
        return max(sizes) if self.blocks else 0.0

    def live_tensors(self) -> int:
        """Separate allocations alive at the peak: the saved tensors of every micro-batch in
        flight, and the parameters' tensors (weights, gradients and, without a flat wrapper,
        the optimizer's two states per weight)."""
        per_mb = sum(self.saved(l)[1] for l in self.blocks)
        per_param = 4 if self.layout.wrapper.startswith("torch") else 2
        weights = 12 * len(self.blocks) + 4
        return int(self.in_flight * per_mb + per_param * weights)

    # -- gradients -------------------------------------------------------------------------------
    def _head_grads(self) -> float:
        """Weight gradients the last stage's head and final norm make before the first block's
        backward (the tied head's stays in autograd's buffer until the embedding's backward)."""
        if not self.last:
            return 0.0
        head = self.layers[-1]
        norm = 2 * self.model.hidden_size * self.ctx.param_bytes
        tied_here = head.tied_key is not None and self.first
        return norm + (0.0 if tied_here else head.params * self.ctx.param_bytes)

    def _word_embedding_grad(self) -> float:
        """The word embedding's [V/tp, h] weight gradient (the tied head's)."""
        return self.vocab / self.tp * self.model.hidden_size * self.ctx.param_bytes

    # -- the candidates -------------------------------------------------------------------------
    def moments(self) -> List[_Moment]:
        out = []
        kept, chunks = self._chunk_parts()
        per_mb = self.stage_input() + kept + self.head_items()
        if not self.blocks:
            return self._step_moment()
        later = self.gas > 1
        flights = [(self.in_flight, False)]
        if later:
            flights.append((min(self.num_stages - self.stage, self.gas - 1)
                            if self.pipelined else 1, True))
        for in_flight, accumulate in flights:
            out.append(self._top_block(per_mb, kept, chunks, in_flight, accumulate))
            if self.last:
                out.append(self._head_forward(per_mb, in_flight, accumulate))
                out += self._head_backward(per_mb, in_flight, accumulate)
                out.append(self._final_norm_backward(per_mb, in_flight, accumulate))
        out += self._step_moment()
        return out

    def _common(self, mo: _Moment, accumulate: bool, made_grads: float,
                step: bool = False) -> _Moment:
        L = self.layout
        mo.add("weights", self.weights).add("master_weights", self.master)
        mo.add("optimizer_states", self.states)
        if L.grads_persistent or accumulate:
            mo.add("gradients", self.full_gradients)
        else:
            mo.add("gradients", min(made_grads * L.gradient / max(self.ctx.param_bytes, 1),
                                    self.full_gradients))
        mo.add("buffers", self.pipe_buffers())
        if L.reduce_in_backward and not step:
            mo.add("buffers", L.reduce_buffer)
        mo.add("other", self.other())
        if self.pipelined and self.first and not step:
            # the raw micro-batches this iteration has loaded so far, beside the last one's
            loaded = self.in_flight + (1 if accumulate else 0)
            mo.add("other", loaded * 8 * self.training.micro_batch_size * (self.model.seq_length + 1))
        if self.last and self.pipelined:
            mo.add("logits", self.slots * logits_bytes(self.ctx, self.vocab))
        return mo

    def _top_block(self, per_mb, kept, chunks, in_flight, accumulate) -> _Moment:
        ctx = self.ctx
        blocks, ckpt = chunks[-1]
        top = blocks[-1]
        mo = _Moment(f"backward of the top block ({'a later' if accumulate else 'the first'} "
                     f"micro-batch, {in_flight} in flight)")
        # the gradient arriving at the top block: the final norm's input gradient (last stage,
        # [b, s, h]); on other stages it is the received-gradient buffer (counted in buffers)
        incoming = ctx.gathered if self.last else 0.0
        walk: BackwardPeak = _backward(ctx, _kind(top), accumulate, incoming, self.last)
        acts = in_flight * per_mb - self.head_items()
        if self.last:
            # _post_transformer_block's transposed copy replaced the top block's output
            acts -= ctx.hidden
        else:
            # every micro-batch in flight keeps only its output's partition (pipe-partitioned)
            acts -= in_flight * (ctx.hidden - self.stage_output())
        if ckpt:
            # recomputed: the chunk's blocks, saved again; their output included
            rot = self._rotary_copies()
            recomputed = sum(self.saved(l)[0] + rot for l in blocks)
            mo.add("recompute", recomputed - walk.released)
            mo.add("temporaries", self.model.seq_length ** 2)  # the mask's zero gradient
        else:
            acts -= walk.released
        mo.add("activations", acts)
        mo.add("temporaries", walk.temporaries)
        if self.pipe_partitioned and not self.last:
            # _exec_backward_pass rebuilds the full output from its partition and the full
            # gradient from the received one (PartitionedTensor.full) for the backward
            mo.add("temporaries", 2 * ctx.hidden)
        if self.last and self.first and self.layers[-1].tied_key is not None:
            # the tied head's weight gradient waits in autograd's input buffer for the
            # embedding's backward to add its part
            mo.add("temporaries", self._word_embedding_grad())
        self._received(mo, in_flight)
        return self._common(mo, accumulate, self._head_grads() + walk.gradients)

    def _received(self, mo: _Moment, in_flight: int, held: Optional[int] = None) -> None:
        """The received activations alive: on a middle stage, each in-flight micro-batch's;
        on the last stage the current one's, and those of the `held` micro-batches whose
        logits still sit in the pipeline's output slots: each keeps its autograd graph, and
        with it its received input and that input's gradient (steady state: the slots hold
        the previous micro-batches, of this iteration or the last)."""
        if not self.pipelined or self.first:
            return
        if self.pipe_partitioned:
            # the slot holds the rebuilt activation the forward made and ran on: counted once,
            # as the micro-batch's input (stage_input); the last stage's held slots keep theirs
            if self.last:
                held = self.slots - 1 if held is None else held
                mo.add("activations", held * self.ctx.hidden)
                mo.add("temporaries", held * self.ctx.hidden)
            return
        if self.last:
            held = self.slots - 1 if held is None else held
            mo.add("buffers", (1 + held) * self.ctx.hidden + self.model.seq_length ** 2)
            mo.add("temporaries", held * self.ctx.hidden)
        else:
            mo.add("buffers", in_flight * self.received())

    def _head_forward(self, per_mb, in_flight, accumulate) -> _Moment:
        """The head's forward and the loss on the last stage: the new logits (and the loss's
        fp32 copy) are made while the pipeline's output slots still hold earlier logits --
        the slot being reused holds its previous micro-batch's until the forward returns."""
        ctx = self.ctx
        mo = _Moment(f"forward of the head and loss ({in_flight} in flight)")
        mo.add("activations", in_flight * per_mb - ctx.hidden)
        logit = logits_bytes(ctx, self.vocab)
        mo.add("logits", logit)  # the new ones; _common adds the pipeline slots' earlier logits
        mo.add("logits", loss_copy_bytes(ctx, self.vocab))
        self._received(mo, in_flight, held=self.slots)
        return self._common(mo, accumulate, 0.0)

    def _head_backward(self, per_mb, in_flight, accumulate) -> List[_Moment]:
        """The loss's and the head's backward on the last stage, every saved tensor alive:
        when the loss ran on an fp32 copy, casting its gradient back (the copy, its softmax
        and the gradient, alive together); then the head's product backward (the logits'
        gradient, the head's input gradient and its weight gradient -- a temporary until
        AccumulateGrad, or the tied embedding's, waiting for the embedding's backward)."""
        ctx = self.ctx
        copy = loss_copy_bytes(ctx, self.vocab)
        logit = logits_bytes(ctx, self.vocab)
        head = self.layers[-1]
        wgrad = self._word_embedding_grad() if head.tied_key else head.params * ctx.param_bytes
        out = []
        for where, logits, temps in (("the loss's cast back", copy + logit, 0.0),
                                     ("the head", logit if copy else 0.0, ctx.gathered + wgrad)):
            if where.startswith("the loss") and not copy:
                continue
            mo = _Moment(f"backward of {where} ({in_flight} in flight)")
            mo.add("activations", in_flight * per_mb - ctx.hidden)
            mo.add("logits", logits + (0.0 if self.pipelined else logit))
            mo.add("temporaries", temps)
            self._received(mo, in_flight)
            out.append(self._common(mo, accumulate, 0.0))
        return out

    def _final_norm_backward(self, per_mb, in_flight, accumulate) -> _Moment:
        """The final norm's backward on the last stage: the head's input gradient arrives, the
        norm's own output is released; every block's saved tensors are still there."""
        ctx = self.ctx
        mo = _Moment(f"backward of the final norm ({in_flight} in flight)")
        walk = final_norm_backward(ctx, accumulate)
        mo.add("activations", in_flight * per_mb - ctx.hidden - walk.released)
        mo.add("temporaries", walk.temporaries)
        head = self.layers[-1]
        if head.tied_key is not None and self.first:
            mo.add("temporaries", self._word_embedding_grad())
        self._received(mo, in_flight)
        return self._common(mo, accumulate, self._head_grads())

    def _step_moment(self) -> List[_Moment]:
        """After the last backward, every gradient made: the gradient reduction with its
        buffers (a flat copy of the gradients, ZeRO's buckets), then the optimizer step with its
        transients (the reduction's buffers gone; ZeRO has moved the gradients into this
        rank's partition); the pipeline's slots keep their logits and inputs."""
        L = self.layout
        reduce = _Moment(f"{_STEP}: gradient reduction")
        reduce.add("buffers", L.reduce_at_step)
        step = _Moment(f"{_STEP}")
        step.add("temporaries", L.step_transient * self.stage_params)
        if L.wrapper == "FP16_Optimizer":
            # its per-parameter fp32 copies exist for one parameter group at a time: the
            # weight-decay group, without the norms and biases
            step.add("temporaries", -4 * self.no_decay_params())
        out = []
        for mo in (reduce, step):
            self._common(mo, True, 0.0, step=True)
            if mo is step and L.grads_leave_at_step:
                mo.add("gradients", -self.full_gradients)
            if self.pipelined and not self.first and self.last:
                mo.add("buffers", self.slots * self.ctx.hidden + self.model.seq_length ** 2)
                mo.add("temporaries", self.slots * self.ctx.hidden)
            out.append(mo)
        return out
