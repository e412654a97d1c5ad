"""pdserve bench: a load-testing harness for pdserve and any OpenAI-compatible server.

What to send and when (requests, workloads, arrivals), the records a request fills and
the metric math over them live in ``services.traffic``, shared with the planner. The
modules here follow one run from there to the report:

- ``targets``: how to send them (pdserve gRPC ``Generate`` or OpenAI ``/v1/completions``
  streaming), yielding per-chunk receive times.
- ``served_tokenizer``: the served model's tokenizer, for runs given no ``--tokenizer``.
- ``runner``: drives a run or a rate sweep and fills one ``RequestRecord`` per request;
  ``distributed`` spreads one run over several load-generator processes (Ray actors).
- ``report`` and ``plots``: JSON, JSONL, CSV, PNG plots and one HTML report.
- ``compare``: two summaries side by side, with what differs between their workloads.
- ``simulator``: simulated servers (gRPC and OpenAI SSE) for tests and for the harness's
  own ceiling.
- ``upstack``, ``faults``, ``tokens``, ``reference``, ``procstats``, ``chaos_report``:
  a stack started for chaos and soak runs, the faults injected into it, token-exact
  checks against a reference engine, process figures and the chaos report.
- ``cli``: the ``pdserve bench`` command line.
"""
