"""Pieces shared by the node processes: engine thread, auth, metrics, request conversion."""
