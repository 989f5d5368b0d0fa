"""The load-test suite: realistic scenarios against any OpenAI-compatible server.

    scenario.py   traffic as data (scenarios/*.yaml)      prompts.py   seeded requests from a tokenizer
    arrivals.py   closed loop / Poisson / gamma           client.py    one streamed request -> record
    runner.py     one bounded run                          stats.py     TTFT/TPOT/ITL/E2E, goodput at SLO
    report.py     JSON per run, Markdown table             plots.py     CDF and sweep PNGs
    bench_load.py ``pdserve bench load``                   bench_compare.py ``pdserve bench compare``
"""
