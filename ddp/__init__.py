"""ddp: a data-parallel Reducer built on the public torch.distributed API.

It runs on any process group (ringcomm, gloo, nccl) so the backends can be compared under
the same training code. The Reducer itself (buckets, autograd hooks, overlapping bucket
allreduce) lands here; this package currently provides the namespace it will fill.
"""
