"""An upstream's Batch API results, read back as the store's outcomes: OpenAI's output and error
lines and Anthropic's result lines, each kind of answer; and the usage a ledger row bills."""

from tokenway.routing.upstream_batches import _multipart, anthropic_outcome, openai_outcome, usage_of

BODY = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                                     "prompt_tokens_details": {"cached_tokens": 2}}}


def test_openai_lines_become_outcomes():
    answered = openai_outcome({"custom_id": "a", "response": {"status_code": 200, "request_id": "r", "body": BODY},
                               "error": None})
    assert (answered.outcome, answered.status_code, answered.response) == ("succeeded", 200, BODY)
    refused = openai_outcome({"custom_id": "b", "response": {"status_code": 400, "body": {"error": {"message": "x"}}}})
    assert (refused.outcome, refused.status_code) == ("failed", 400)
    cancelled = openai_outcome({"custom_id": "c", "response": None,
                                "error": {"code": "batch_cancelled", "message": "cancelled"}})
    assert (cancelled.outcome, cancelled.error["code"]) == ("cancelled", "batch_cancelled")
    expired = openai_outcome({"custom_id": "d", "response": None, "error": {"code": "batch_expired"}})
    assert expired.outcome == "expired" and expired.response is None
    unanswered = openai_outcome({"custom_id": "e", "response": None, "error": None})
    assert unanswered.outcome == "failed" and unanswered.error["code"] == "upstream_error"


def test_anthropic_lines_become_outcomes():
    message = {"id": "msg_1", "type": "message", "usage": {"input_tokens": 4, "output_tokens": 2}}
    succeeded = anthropic_outcome({"custom_id": "a", "result": {"type": "succeeded", "message": message}})
    assert (succeeded.outcome, succeeded.response) == ("succeeded", message)
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    errored = anthropic_outcome({"custom_id": "b", "result": {"type": "errored", "error": error}})
    assert (errored.outcome, errored.status_code, errored.response) == ("failed", 400, error)
    assert anthropic_outcome({"custom_id": "c", "result": {"type": "canceled"}}).outcome == "cancelled"
    assert anthropic_outcome({"custom_id": "d", "result": {"type": "expired"}}).outcome == "expired"


def test_usage_of_either_shape():
    assert usage_of(BODY) == (7, 2, 3, 0)
    assert usage_of({"usage": {"input_tokens": 4, "output_tokens": 2, "cache_read_input_tokens": 5,
                               "cache_creation_input_tokens": 1}}) == (10, 5, 2, 0)
    assert usage_of({"usage": {"prompt_tokens": 9, "total_tokens": 9}}) == (9, 0, 0, 0)  # embeddings
    assert usage_of({"error": {}}) == usage_of(None) == (0, 0, 0, 0)


def test_the_upload_is_one_multipart_form():
    body = _multipart("B", {"purpose": "batch"}, ("file", "batch.jsonl", b'{"custom_id":"a"}\n'))
    assert body == (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                    b'--B\r\nContent-Disposition: form-data; name="file"; filename="batch.jsonl"\r\n'
                    b'Content-Type: application/jsonl\r\n\r\n{"custom_id":"a"}\n\r\n--B--\r\n')
