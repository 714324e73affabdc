"""Protobuf messages the collectors speak: the kubelet PodResources API (v1)."""
