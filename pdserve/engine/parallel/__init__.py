"""Tensor parallelism inside one engine: sharding (`sharding`), the process group (`group`),
rank 0's driver of the other ranks (`launcher`) and their entry point (`worker`)."""
