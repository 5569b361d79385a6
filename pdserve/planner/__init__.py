"""`pdserve plan`: choose the prefill/decode shape of a cluster by simulation, as DistServe does.

`profile.py` (forward-pass time by tokens, per degree: GPUs of tensor parallelism or CPU threads),
`workload.py` (requests from a trace or length distributions, and their arrival times),
`instances.py` (a prefill instance and a decode or colocated instance, each a small state machine),
`cluster.py` (the discrete-event simulation of one shape at one rate), `search.py` (every shape
within a budget, and a binary search on the rate for each), `measure.py` (a profile of the local
model, measured with the batch job's profiler). Every figure the planner prints is modelled.
"""
