"""Pieces shared by the node processes: engine thread, request scope, error mapping, metrics, conversion."""
