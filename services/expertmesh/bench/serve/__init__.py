"""``expertmesh bench serve``: streaming clients against ``expertmesh up``, next to
plain transformers ``generate`` on the same checkpoint.

Workload: ``--clients`` N threads, each with its own ``expertmesh.client.Client``,
each sending ``--requests-per-client`` R requests one after the other (greedy,
``stop_at_eos=False``, exactly ``--max-new-tokens`` M tokens each). Prompts are
seeded token ids of ``--prompt-tokens``/2 to ``--prompt-tokens`` tokens (all of
``--prompt-tokens`` with ``--equal-prompts``); request r
of client c uses prompt ``r * N + c``.

Runs
- *platform*: the N clients stream from ``expertmesh up`` — started in this
  process over a fresh data plane (``--groups`` expert groups on local Ray, or
  with ``--groups-as process`` in plain processes, no Ray: ``bench.platform``),
  or an already running one at ``--target`` (then ``--model`` must be its
  checkpoint). ``--device`` puts the router's model and the baseline's on a GPU.
- *transformers generate, one at a time*: the N × R prompts one after the other.
- *transformers generate, batched*: R calls, each with N prompts left-padded
  into one batch (greedy, with no end-of-sequence token: exactly M tokens, as
  the platform streams them with ``stop_at_eos=False``).
- with ``--classifier``, the query classifier's added time to first token: three
  more platform runs with the same clients, each request a *text* prompt (the
  classifier's eval split, queries of at most ``--prompt-tokens`` tokens, seeded
  order): ``exact``; ``prefer`` with ``alpha = 0`` and the query's domain given;
  the same without a domain, so the router classifies each request once before
  prefill. ``prefer`` needs a domain, and ``alpha = 0`` makes its bias 0
  (routing stays the stock gate's); it still needs a capability profile of the
  domain (else the request is refused), so the platform started here gets
  neutral ones (lift 1) for the classifier's domains, and a ``--target`` must hold
  profiles (``expertmesh profile build``) of every domain its classifier
  assigns. Classified minus domain-given is the classifier alone; classified
  minus exact adds the policy's plumbing (a zero bias per MoE layer, counting by
  domain). Beside them, the classifier's own time per call on the same texts in
  this process (as ``expertmesh classifier eval`` measures it).

Figures: tokens/s = generated tokens / wall time of the run; inter-token
latency (ITL) = time between consecutive streamed tokens of one request
(a streamed chunk's gap divided by the tokens it carries; for ``generate``, the
gaps between its streamer's calls, one per step); time to first token (TTFT)
from sending the request (or calling ``generate``) to its first token. One
untimed warm-up request precedes each run; then the in-process platform's prefix
cache is emptied (``Engine.reset_prefix_cache``), so no timed prompt is found
cached by the warm-up or by an earlier repeat or thread count. A ``--target``
keeps its cache: its later repeats find their prompts cached (serve it with
prefix caching off to compare them).

``--repeats`` K runs the platform and both ``generate`` baselines K times,
interleaved (platform, one at a time, batched, platform, ...), so a machine whose
speed drifts slows both sides alike; each row is the repeat of median tokens/s
(the lower middle one for even K), with every repeat's tokens/s beside it in the
JSON (``tokens_per_s_repeats``), and the ratios are of those medians.

``--sweep 1,8,16,32`` repeats the whole benchmark (a fresh platform each) at each
of those client counts, with the other options as given (issue 22's sweep:
``--prompt-tokens 480 --max-new-tokens 96 --requests-per-client 1``), and prints one
row per point: platform and batched ``generate`` tokens/s, their ratio, ITL p50 of
each, the mean step time per decode token of each (a decode step's wall time over the
sequences it advanced: the in-process engine's own step totals, ``serving.step_tally``, and
the batched ``generate`` streamer's calls after the first token), the KV pool's peak and
preemptions. ``--equal-prompts`` makes every prompt ``--prompt-tokens`` long, so the
sequences of a point are of equal length (issue 22's flat decode step per sequence).
``--shapes 480x96,64x256`` runs the benchmark at each prompt and answer length (tokens; long prompts with
short answers, short prompts with long answers) in place of ``--prompt-tokens`` and ``--max-new-tokens``, and
with ``--sweep`` at each client count of each: one row per (shape, clients), the shape in the row (issue 41's
sweep against vLLM: ``--baseline vllm --sweep 1,8,16,32,64 --shapes 480x96,64x256``). Every shape is checked
against the model's context before the first point starts.

``--shared-prefix P`` runs the prefix cache's benchmark instead (``bench.shared_prefix``);
``--guard SCORER`` the consistency guard's at load (``bench.guarded_serve``).

Modules, one job each: ``cli`` (the command, its flags, the run they choose), ``options``
(the options and their checks), ``workload`` (the prompts), ``served`` (the platform: started
here or a ``--target``, and its streaming clients' run), ``baselines`` (what the platform is
compared with, by name, behind one interface), ``classifier_runs`` (``--classifier``),
``drivers`` (a run, its repeats and thread counts, the sweep), ``stats`` (requests' timings ->
a run's figures) and ``tables`` (the printed report).
"""

from __future__ import annotations

from expertmesh.bench.serve.cli import add_command
from expertmesh.bench.serve.drivers import run, run_sweep
from expertmesh.bench.serve.options import Options, validate
from expertmesh.bench.serve.served import platform_run, served_here
from expertmesh.bench.serve.stats import same_tokens
from expertmesh.bench.serve.tables import sweep_table, table
from expertmesh.bench.serve.workload import FIRST_TOKEN_ID, prompts, text_prompts, text_prompts_summary

__all__ = [
    "FIRST_TOKEN_ID",
    "Options",
    "add_command",
    "platform_run",
    "prompts",
    "run",
    "run_sweep",
    "same_tokens",
    "served_here",
    "sweep_table",
    "table",
    "text_prompts",
    "text_prompts_summary",
    "validate",
]
