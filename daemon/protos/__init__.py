"""Protobuf messages tfprofd speaks: TensorFlow profiler captures, the kubelet PodResources API."""
