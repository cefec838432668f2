"""doel's serving stage: an export bundle over HTTP, without torch (arrives with the serve issue)."""
