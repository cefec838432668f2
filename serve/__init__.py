"""doel's serving stage: an export bundle over HTTP without torch (the serve issue)."""
