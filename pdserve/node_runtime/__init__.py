"""What the serving processes share: the node runtime (engine thread, request scope, error mapping,
metrics, conversion, NodeConfig), gRPC auth, flag/environment config, discovery, the supervisor."""
