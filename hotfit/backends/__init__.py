"""Model servers hotfit drives, behind one boundary (:mod:`backends.base`): llama.cpp's llama-server
(:mod:`backends.llama_server`) and OpenVINO GenAI (:mod:`backends.openvino`); :mod:`backends.select`
picks one for a plan, :mod:`backends.http_chat` is the OpenAI-compatible HTTP chat endpoint.

This file imports nothing: ``python -m backends.openvino.worker`` must start without hotfit.
"""
