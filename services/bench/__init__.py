"""pdserve bench: a load-testing harness for pdserve and any OpenAI-compatible server.

The modules follow one run from input to report:

- ``records``: ``RequestSpec`` (what to send) and ``RequestRecord`` (what one request
  measured), plain dataclasses that round-trip through JSONL, so records from several
  load-generator processes merge by concatenation.
- ``workload``: the requests to send (random lengths, shared prefixes, mixed long/short,
  ShareGPT files, prompt files), as token ids counted with the model's tokenizer.
- ``arrivals``: when to send them (Poisson, gamma, constant, ramps, limits).
- ``targets``: how to send them (pdserve gRPC ``Generate`` or OpenAI ``/v1/completions``
  streaming), yielding per-chunk receive times.
- ``runner``: drives a run or a rate sweep and fills one ``RequestRecord`` per request.
- ``metrics``: pure math over records (TTFT, TPOT, ITL, E2E, throughput, goodput, anatomy).
- ``report`` and ``plots``: JSON, JSONL, CSV, PNG plots and one HTML report.
- ``compare``: two summaries side by side.
- ``simulator``: simulated servers (gRPC and OpenAI SSE) for tests and for the harness's
  own ceiling.
- ``cli``: the ``pdserve bench`` command line.
"""
