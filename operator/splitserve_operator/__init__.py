"""The LLMService operator: kopf handlers (handlers.py) over pure builders that turn an LLMService
spec into the desired child objects (children.py, podtemplate.py, workerconfig.py) and its status
(status.py). Never imports torch: the operator image has none."""

GROUP = "splitserve.io"
VERSION = "v1alpha1"
PLURAL = "llmservices"
KIND = "LLMService"
