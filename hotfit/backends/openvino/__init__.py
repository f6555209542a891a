"""OpenVINO GenAI: session settings and pre-start checks (``config``), the worker process and its
protocol (``worker``, ``protocol``), the session (``session``), tool calls in the model's own syntax
(``toolcall``, ``chat``), the allocation report (``allocation``), and the Backend (``backend``).

This file imports nothing: the worker (``python -m backends.openvino.worker``) must start fast.
"""
