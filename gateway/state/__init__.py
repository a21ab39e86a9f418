"""Cluster state shared by the gateway's parts: one interface, an in-memory and a Redis backend."""
