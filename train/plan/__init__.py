"""``hybridtron plan``: per-GPU memory and per-step communication of a config on a cluster shape, before a launch.

Memory is not guessed from formulas: two training steps (forward, backward, optimizer) of one rank run on fake
tensors (``FakeTensorMode``: shapes and dtypes, no storage) over a fake process group of the whole world size
(``FakeStore``, backend "fake": DTensor and device meshes work on it, collectives move nothing), and over the
second (the steady state: optimizer state exists) torch's memory trackers record the peak by category: sharded and gathered weights, gradients, optimizer state,
activations and temporaries. The rank is built by the trainer's own code, in the trainer's order: the layout
checks and the device mesh (``Mesh.setup``), the pipeline cut (``train/parallel/pipeline.py``), tensor parallelism
(``apply_tensor_parallel``: the model's own DTensor plan), expert parallelism (``apply_expert_parallel``: this
rank's experts), context parallelism (``apply_context_parallel``: the rank runs T/cp positions; attention
passes key/value blocks round a ring, delta-rule layers gather each piece's state map), FSDP2
(``apply_data_parallel``), then the optimizer; and its steps run through the trainer's engine (``train/engine.py``:
``run`` and ``update``, so HSDP's deferred all-reduce and the step-wide weight casts are the trainer's too). So the
plan follows the model code as it is: MoE, delta-rule and structured layers and activation
checkpointing included. Each fused op runs as the GPU run would pick it (``gpu_kernels``: our Triton kernels'
``autograd.Function`` with their custom ops' fake implementations), so what is kept for backward is what those
kernels keep: the fused attention its output and log-sum-exp (not the T x T probabilities of the reference's
autograd), the chunked delta rule its inputs, decay terms and chunk states, the fused loss its two gradients (no
logits), norms their inputs and inverse RMS. Dtypes are fp32, or bf16 where CPU autocast casts (matmuls) when the
run trains in bf16 (CUDA's autocast casts the same ops).

Where fake tensors cannot follow the real run, this is what the plan assumes instead:

- MoE routing is balanced: every expert gets N k / E of a micro-batch's N k token assignments (so under ep every
  rank receives as many rows as it sends). A fake tensor has no values, and the routing counts set shapes
  (``_KnownValues`` below). An unbalanced router holds more rows on the ranks of its busiest experts.
- Pipeline schedules run their own action order for the planned rank: torch's ``pipeline_order`` of the
  configured schedule (gpipe: all forwards, then all backwards, so every micro-batch's activations are held at
  once; 1f1b: stage s runs pp - s forwards first, so it holds up to pp - s micro-batches; interleaved schedules
  as torch orders them). torch's runtime itself cannot run on one process (it exchanges shapes and votes with
  the other stages), so the replay keeps what it keeps: one receive buffer per micro-batch for the activations
  and one for their gradients, allocated once, and the received activations' gradients until the next step, in
  the dtype the stages send (bf16 under FSDP2's bf16 mixed precision, which casts every block's inputs; else fp32).
  Under FSDP the gradients stay unsharded until the last micro-batch, as torch's stages arrange it, in FSDP2's
  fp32 accumulation copies: counted as gradients. zero_bubble splits each backward in an input half (I) and a
  weight half (W): a micro-batch's activations are held from its forward to its W (the I half keeps the graph for
  the W half); the gradients the I half keeps for W are not counted.
- The tokens are uniformly random (drawn for real: what is computed from them alone, such as which labels fall in
  a rank's vocabulary shard, is as in a real step). Text is skewed towards frequent tokens.
- ``parallel.offload: cpu`` (FSDP2's CPU offload): the sharded weights, sharded gradients and optimizer state are
  counted in host memory (``host``), not in the GPU peak; what is gathered for compute stays on the GPU.
- ``train.compile``: the blocks are planned eager (torch.compile on fake tensors only falls back to them); compiled,
  fused elementwise ops keep fewer temporaries, so the real activation peak is typically lower. The table says so.
- ``train.fp8``: planned as the cluster's GPUs run it (the rank's layout rules are checked for the cluster, not this
  host, which needs no FP8 tensor cores): torchao's Float8Linear with its FP8 casts, saved tensors and (tensorwise
  under FSDP2) FP8 weight all-gathers. The communication volumes and step time below count those weights at their
  bf16/fp32 bytes and the matmuls at the bf16 peak; the table says so.
- ZeRO-0 is planned without DDP's wrapper (its C++ reducer cannot run on fake tensors): with
  ``gradient_as_bucket_view`` its buckets are the gradients, so the replicated model holds what the plain one does.

Every pipeline stage is planned (the first rank of each): stages differ in layers, embeddings and in-flight
micro-batches; ranks of one stage differ only by their shard, and a stage alike to one planned before in its
layers, place and schedule actions (GPipe's middle stages) takes its plan.

Not every layer is traced (``reduced.py``): layers of one kind hold the same memory, so each rank is traced with
the first two and last three layers of each of its stages, and once more with one layer of each kind that
repeats between them; the peak, place by place in the step, is extrapolated to the real count of each kind. The
traces run one micro-batch on top of the gradients of an earlier one (a step's second micro-batch, which holds at
least what its first does), and a pipeline's first step one micro-batch per stage. A 1F1B stage with w warm-up
forwards is traced on min(w, 2) + min(m - w, 2) micro-batches, not all m (``ReplayedSchedule.shorten``): after its first
(forward, backward) pair every pair repeats the one before, holding besides only what each finished micro-batch
leaves (the gradient received into its buffer, a logged loss), so the places from the second pair on get m - w - 2
times that (measured over the second pair) and the pairs left out hold no more; each warm-up forward after the second
holds what the second holds (its micro-batch's activations), added w - 2 times from the first pair to the last
backward. So 1F1B stages alike in all but their warm-ups (the middle stages of one layer count) share one trace
(``reduced._alike_in_1f1b``). The traces of a rank, and the distinct ranks after the first, run side by side in
processes forked from the built rank (``workers.py``; ``hybridtron plan --jobs``, one per core by default; the
library's calls and ``--measure``'s prediction run them in this process). ``exact=True``
(``plan_table``, ``plan_ranks``, ``compare``) traces every layer as described above: the reference the
extrapolation is tested against (``tests/train/test_plan_reduced.py``: equal to the byte, or within 64 bytes: a
few scalars). ``--measure`` runs the same two steps on real tensors in the job's real layout (under torchrun, every rank; a pipeline through torch's real schedule) and
prints the prediction beside the measured peak of the rank the plan found heaviest: the check that the plan is
right.

``--measure`` also counts the bytes every collective of the measured step sent (``CollectiveBytes``: DDP, FSDP2,
DTensor, pipelining and our own calls alike, as ring algorithms move them) beside the volumes below.

Step time (``step_time``): the step's model FLOPs at a configured peak x MFU, each dimension's bytes at the intra-
or inter-node bandwidth (whether its process groups fit in a node), the pipeline bubble, and what the engines
overlap; ``hybridtron plan`` prints the breakdown.

Communication per optimizer step and GPU, in bytes sent (ring algorithms: as many are received). m micro-batches
per step of B sequences of T tokens, d = model.d_model, f(n) = (n - 1) / n; c = 2 in bf16 runs, else 4
(projection outputs); the parameters P and
the layer counts L are those of the planned rank (its tp shard, its pipeline stages); head counts H are those
of the rank's tp shard:

  dp  n = dp x cp ranks average the gradients; P without the experts sharded over ep; g = 2 when FSDP gathers
      bf16 weights (parallel.mixed_precision), else 4
      ZeRO-0 (DDP): all-reduce of the gradients once per step:                 2 f(n) 4 P
      ZeRO-2: all-gather of the weights (forward) and reduce-scatter of the gradients, per micro-batch:
                                                                               m (f(n) g P + f(n) 4 P)
      ZeRO-3: the all-gather again in backward, but for the root's parameters P_root (embeddings, final norm,
      head: FSDP2 keeps them gathered from forward to backward):             m (f(n) g (2 P - P_root) + f(n) 4 P)
      under pp torch's stages keep the weights gathered from each backward to the next forward and reduce-scatter
      once per step (REDUCE_GRAD): ZeRO-2 gathers once, ZeRO-3 each block m + 1 times (every stage's actions are
      F^a (F B)^b B^a: every forward gathers but one after a backward, and so does the first backward), the
      root once (measured on gloo, pp 2 x dp 2, 4 micro-batches, bf16: to the byte on both stages):
                                                 ZeRO-2:  f(n) g P + f(n) 4 P
                                                 ZeRO-3:  f(n) g (P_root + (m + 1) (P - P_root)) + f(n) 4 P
      HSDP (parallel.dp_shard = s < dp): the all-gathers and reduce-scatters above run in the groups of s x cp
      ranks (n = s cp in them), and the accumulated shards are all-reduced across the dp / s groups once per
      step, after the last micro-batch (column dp_replicate):                  2 f(dp / s) 4 P / (s cp)
      ep > 1: the expert gradients all-reduced over their dp cp / ep copies:   2 f(dp cp / ep) 4 P_experts
  tp  (T: the rank's piece, seq_len / cp, under context parallel; r = 2 where FSDP2's bf16 mixed precision makes the
      residual stream bf16, else 4)
      per layer: all-gather of the two norm outputs (c where the norm's readers are all projections, model/lm.py:
      the first norm without scale vectors, the second before a SwiGLU too; else r: n1 + n2 bytes) and
      reduce-scatter of the two projection outputs (c) in forward, the reverse in backward:
                                                                               m L 2 f(tp) B T d (n1 + n2 + 2 c)
      activation checkpointing repeats the forward ones in backward:           + m L f(tp) B T d (n1 + n2 + 2 c)
      the embedding's output reduce-scattered, its gradient all-gathered:       m 2 f(tp) B T d r
      the final norm's output all-gathered, its gradient (whole sequences) all-reduced by the vocabulary-parallel
      loss:                                                                    m f(tp) B T d (r + 2 c)
      (measured on gloo at tp 2 with dense SwiGLU layers, fp32, bf16, bf16 under FSDP2: to the byte but the loss's
      scalars; MoE and scale-vector layers follow the same rule from the code, not measured)
  pp  the stage's output and its input's gradient, (B, T/tp, d) each, bf16 (b = 2) under FSDP2's mixed precision
      (ZeRO-2/3 with parallel.mixed_precision auto in bf16 runs), else fp32 (b = 4) (the first stage sends no
      gradient, the last no output), per stage of the rank:                   m 2 B (T / (cp tp)) d b
      tied embeddings: first and last stage all-reduce the embedding's gradient once per step: V d 4 / tp
  ep  per MoE layer, balanced routing: the routed copies of the tokens (k per token) to their experts' ranks
      and back, and their gradients, in the experts' compute dtype (measured on gloo, fp32 and bf16):
                                                                               m L_moe 2 f(ep) B (T / cp) k d 2 c
  cp  per attention layer (ring attention): cp - 1 passes of a key and a value block in forward, cp - 1 again in
      backward and cp of their fp32 gradients:                     m L_attn B (T / cp) H_kv D (4 (cp - 1) c + 8 cp)
      per delta-rule layer: all-gathers of both chunks' state maps (A | B), fp32, and of the K - 1 convolution
      inputs before each chunk, and the reduce-scatters of their gradients:
                                                m L_delta 2 (cp - 1) 2 B (H_v D_k (D_k + D_v) 4 + (K - 1) C c)
      document ids (int64) gathered per micro-batch when masked:               m (cp - 1) B (T / cp) 8
"""

from hybridtron.train.plan.collectives import CollectiveBytes
from hybridtron.train.plan.comm import comm_bytes
from hybridtron.train.plan.memory import GIB, _KnownValues, build_rank, fake_world, gpu_kernels, simulate, step_peak
from hybridtron.train.plan.reduced import layer_kinds, plan_rank, plan_ranks
from hybridtron.train.plan.step_time import Hardware, step_time
from hybridtron.train.plan.table import (
           compare,
           format_comparison,
           format_table,
           gather_measurements,
           measure,
           n_params,
           plan_table,
           release_distributed_state,
           with_zero_stage,
)

__all__ = ["GIB", "CollectiveBytes", "Hardware", "_KnownValues", "build_rank", "comm_bytes", "compare", "fake_world",
           "format_comparison", "format_table", "gather_measurements", "gpu_kernels", "layer_kinds", "measure",
           "n_params", "plan_rank", "plan_ranks", "plan_table", "release_distributed_state", "simulate", "step_peak",
           "step_time", "with_zero_stage"]
