"""The Redis prefix index: an advisory mirror of which worker holds which KV blocks on which tier.

Torch-free (the router imports it). Workers write through ``publisher.IndexPublisher``; routers read
through ``client.IndexClient``; both run the Lua scripts of ``scripts.py`` under the key scope of
``schema.py``. ``redis_server.py`` starts the embedded server ``pdserve up`` uses. Redis holds no
state that the workers cannot rebuild: it runs with persistence off, and losing it costs hit rate only.
"""
