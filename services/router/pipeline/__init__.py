"""The request pipeline both APIs share: tokenize and validate once (frontend.py, limits.py),
admit into the router's bounded queue (admission.py), then stream one
Generation's detokenized deltas with stop strings applied (generation.py); debug mode's
route and TTFT breakdown headers (debug_route.py)."""
