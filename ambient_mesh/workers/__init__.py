"""ZTUNNEL_WORKER_THREADS: worker processes sharing each listener, fed by one owner.

Counterpart: ztunnel's data-plane worker threads. One Python interpreter runs one event loop
on one core at a time, so our workers are processes: the owner (this node proxy's main
process) keeps xDS, the CA client and certificates, ZDS, the DNS proxy and the admin, stats
and readiness servers, and feeds each worker over a Unix socketpair (codec.py, channel.py):
its state, its certificates, and every listening socket, which all workers accept from (owner.py).
A worker (worker.py) serves connections exactly as the single-process proxy does. With one
worker (our default; see config.DEFAULT_WORKER_THREADS) none of this runs.
"""
