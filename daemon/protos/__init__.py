"""Protobuf messages the agent speaks: TensorFlow profiler captures and XPlane traces."""
