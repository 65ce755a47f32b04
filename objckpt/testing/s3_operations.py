"""Which S3 API operation a path-style HTTP request is, from its method, path and query.

:class:`~objckpt.testing.FaultProxy` sees raw HTTP, but tests speak in S3
operations (``UploadPart``, ``HeadBucket``...): rules match them and counts are
kept by them. Path-style requests (what botocore sends to an IP endpoint such as
a moto server) carry everything needed to tell the operations apart.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

__all__ = ["s3_operation"]


def s3_operation(
    method: str, path: str, query: Mapping[str, Any], headers: Mapping[str, str]
) -> str:
    """The S3 API operation of a path-style request (``UploadPart``, ``HeadBucket``...)."""
    parts = urllib.parse.unquote(path).lstrip("/").split("/", 1)
    copy = any(k.lower() == "x-amz-copy-source" for k in headers)
    if not parts[0]:
        return "ListBuckets"
    if len(parts) == 1 or not parts[1]:
        bucket_ops = {
            ("HEAD", None): "HeadBucket",
            ("GET", "uploads"): "ListMultipartUploads",
            ("GET", "list-type"): "ListObjectsV2",
            ("GET", "location"): "GetBucketLocation",
            ("GET", "versioning"): "GetBucketVersioning",
            ("GET", "session"): "CreateSession",
            ("POST", "delete"): "DeleteObjects",
            ("PUT", None): "CreateBucket",
            ("DELETE", None): "DeleteBucket",
        }
        for (m, q), name in bucket_ops.items():
            if m == method and (q is None or q in query):
                return name
        return "ListObjects" if method == "GET" else f"Bucket{method.title()}"
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        return "CopyObject" if copy else "PutObject"
    if method == "POST":
        return "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "GET":
        return "ListParts" if "uploadId" in query else "GetObject"
    if method == "HEAD":
        return "HeadObject"
    return f"Object{method.title()}"
