"""Which workers serve a sample: the worker pool's health and load view (worker_pool.py), the
load policy (policy.py, also the null plan), KV-aware routing through the prefix index
(prefix_aware.py over the pure route_plan.py and prefix_scoring.py), and the record of
decisions (route_decisions.py). No I/O beyond the pool's health polls and the index client."""
