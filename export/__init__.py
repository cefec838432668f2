"""doel's export stage: checkpoint -> ONNX bundle (arrives with the export issue)."""
