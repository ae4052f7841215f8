//! kvx-ingress: the OpenAI-compatible HTTP/SSE front door.

#![forbid(unsafe_code)]
