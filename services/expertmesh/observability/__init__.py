"""Looking at how a served MoE model routes: the sparsity probe and the heatmaps.

- ``sparsity``: pure computations over the router's load counts (numpy in,
  dataclasses out): active parameters per token, expert utilisation, routing
  entropy, balancedness over expert groups. Its docstring is the glossary.
- ``heatmap``: pure rendering of expert x token-position activation
  frequency per MoE layer to a PNG (matplotlib, no display needed).
- ``bias``: the bias audit's statistics, pure (counts by label value in; shares, concentrations over a
  threshold, disparity and a policy's demographic parity difference against exact out). Its docstring
  has the definitions; ``labels`` parses and bounds the labelled-prompts file.
- ``remote``: the I/O both commands share: ``ListModels``, ``GetLoadStats``
  snapshots and the probe's own traffic over the Inference API.
- the commands, ``expertmesh probe`` and ``expertmesh heatmap``, are ``expertmesh.cli.probe`` and
  ``expertmesh.cli.heatmap``; ``probe --labels`` is ``expertmesh.cli.bias_audit``.

Traces and Prometheus metrics live in ``expertmesh.infra.telemetry``; the Grafana
dashboard over those metrics is ``deploy/grafana/expertmesh-dashboard.json``.
"""
