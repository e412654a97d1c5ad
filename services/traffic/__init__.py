"""Traffic: what requests arrive, when, with what lengths, and how their serving is judged.

Shared by the load tester (``services.bench`` sends it), the planner (``services.plan``
simulates it) and the launcher's live planner (which replays what a stack served):

- ``request``: ``RequestSpec``, one request to send.
- ``workload``: the requests of a run (random lengths, shared prefixes, mixed long/short,
  ShareGPT files, prompt files), as token ids counted with the model's tokenizer.
- ``arrivals``: when they are sent (Poisson, gamma, constant, ramps, limits).
- ``traces``: production traces (Azure CSV, Mooncake JSONL) read as typed records and
  turned into a replay: a window, a rescaled clock and lengths, shared prefixes, turns.
- ``flags``: the command-line flags that describe a workload and its arrivals.
- ``record``: ``RequestRecord``, what one request measured (or was simulated to take).
- ``latency``: one request's TTFT, TPOT, ITL and anatomy, from its record.
- ``slo``: ``SLOs``, the latency bounds goodput counts against.
- ``summary``: a run's summary over its records (latency statistics, throughput, goodput).
- ``overload``: whether a run offered more load than the server served.
- ``intervals``: a metric of repeated runs as a median with a confidence interval.
"""
