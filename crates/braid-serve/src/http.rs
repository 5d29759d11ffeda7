//! The OpenAI-compatible HTTP API on axum ([`router`]): `POST
//! /v1/completions` (whole, or streamed as server-sent events ending with
//! `data: [DONE]`), `GET /v1/models`, `GET /health` and Prometheus'
//! `GET /metrics`. With an API key, every route but `/health` wants
//! `Authorization: Bearer KEY` and answers 401 before any model work.
//! A body that is not JSON, a field the API does not have or a value out
//! of range is a 400 that says which; a full queue is a 429. A streaming
//! client that goes away cancels its request.

use crate::engine::{Accepted, EngineHandle};
use crate::request::{Event, Finish, Request, RequestError};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use braid_data::tokens::Tokenizer;
use braid_model::sample::Sampling;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Tokenizer,
    /// The name `/v1/models` gives the model (and requests may name).
    pub model: String,
    pub context: usize,
    pub api_key: Option<String>,
}

/// The routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .with_state(state)
}

/// An OpenAI-style error body with `status`.
fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "error": {"message": message.into(), "type": kind, "param": null, "code": null}
    });
    (status, Json(body)).into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// Refuses a request without the API key (when there is one).
fn authorized(state: &AppState, headers: &HeaderMap) -> Result<(), Response> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // The same time whatever the key's first wrong byte.
    let ok = given.is_some_and(|g| {
        g.len() == key.len()
            && g.bytes()
                .zip(key.bytes())
                .fold(0u8, |a, (x, y)| a | (x ^ y))
                == 0
    });
    match ok {
        true => Ok(()),
        false => Err(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the key \
             the server was started with (--api-key)",
        )),
    }
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such route: the server has POST /v1/completions, GET /v1/models, GET /health and \
         GET /metrics",
    )
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let st = s.engine.metrics().stats();
    Json(json!({
        "status": "ok",
        "waiting": st.waiting,
        "running": st.running,
        "kv_blocks_used": st.blocks_used,
        "kv_blocks": st.blocks,
    }))
    .into_response()
}

async fn metrics(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.engine.metrics().render(),
    )
        .into_response()
}

async fn models(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model,
            "object": "model",
            "created": now(),
            "owned_by": "braid",
            "max_model_len": s.context,
        }]
    }))
    .into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A prompt: text, or tokens.
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Many(Vec<Value>),
}

/// Stop strings: one or a list.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The body of `POST /v1/completions` (OpenAI's names and defaults;
/// `top_k` is braid's, as vLLM's).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionBody {
    model: Option<String>,
    prompt: Prompt,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
    #[serde(default = "one")]
    temperature: f32,
    #[serde(default = "one")]
    top_p: f32,
    #[serde(default)]
    top_k: usize,
    seed: Option<u64>,
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    logprobs: Option<usize>,
    #[serde(default = "one_n")]
    n: usize,
    #[serde(default)]
    echo: bool,
    user: Option<String>,
}

fn default_max_tokens() -> usize {
    16
}

fn one() -> f32 {
    1.0
}

fn one_n() -> usize {
    1
}

/// The body as a request, or a 400 saying what is wrong.
fn parse(s: &AppState, body: &[u8]) -> Result<(Request, bool), Response> {
    let b: CompletionBody = serde_json::from_slice(body)
        .map_err(|e| bad_request(format!("the request body is not a valid completion: {e}")))?;
    if let Some(m) = &b.model {
        if *m != s.model {
            return Err(error(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "model {m:?} is not served here: this server serves {:?}",
                    s.model
                ),
            ));
        }
    }
    if b.n != 1 {
        return Err(bad_request(format!(
            "n = {}: this server returns one completion per request (send n requests)",
            b.n
        )));
    }
    if b.echo {
        return Err(bad_request(
            "echo is not supported: the prompt is yours already",
        ));
    }
    if matches!(b.logprobs, Some(k) if k > 1) {
        return Err(bad_request(
            "logprobs above 1 are not supported: ask for 0 or 1 (the chosen token's log-probability)",
        ));
    }
    let _ = b.user;
    let prompt = match b.prompt {
        Prompt::Text(t) => s.tokenizer.encode(&t),
        Prompt::Tokens(t) => t,
        Prompt::Many(v) => {
            return Err(bad_request(format!(
                "prompt is a list of {} prompts: send one prompt (a string, or a list of token \
                 ids) per request",
                v.len()
            )))
        }
    };
    let stop = match b.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 4 {
        return Err(bad_request(format!(
            "{} stop strings: at most 4",
            stop.len()
        )));
    }
    let request = Request {
        prompt,
        max_tokens: b.max_tokens,
        sampling: Sampling {
            temperature: b.temperature,
            top_k: b.top_k,
            top_p: b.top_p,
            seed: b.seed.unwrap_or_else(rand_seed),
        },
        stop,
        logprobs: b.logprobs.is_some(),
    };
    Ok((request, b.stream))
}

/// A seed for a request that gave none.
fn rand_seed() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ (std::process::id() as u64).rotate_left(32)
}

/// The answer to a request the engine refused.
fn refused(e: RequestError) -> Response {
    match e {
        RequestError::Busy(_) => error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            e.to_string(),
        ),
        RequestError::Stopped => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            e.to_string(),
        ),
        e => bad_request(e.to_string()),
    }
}

/// Cancels its request when dropped before the end (the client went
/// away mid-stream).
struct CancelOnDrop {
    engine: EngineHandle,
    id: u64,
    done: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.done {
            self.engine.cancel(self.id);
        }
    }
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    let (request, stream) = match parse(&s, &body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let Accepted { id, events } = match s.engine.submit(request).await {
        Ok(a) => a,
        Err(e) => return refused(e),
    };
    let name = format!("cmpl-{id}");
    let guard = CancelOnDrop {
        engine: s.engine.clone(),
        id,
        done: false,
    };
    match stream {
        true => streamed(s, name, events, guard).into_response(),
        false => whole(s, name, events, guard).await,
    }
}

/// The choice's `logprobs` object (OpenAI's legacy completions shape).
fn logprobs_of(s: &AppState, tokens: &[u32], lps: &[f32]) -> Value {
    let texts: Vec<String> = tokens.iter().map(|&t| s.tokenizer.decode(&[t])).collect();
    json!({"tokens": texts, "token_logprobs": lps})
}

async fn whole(
    s: Arc<AppState>,
    name: String,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    mut guard: CancelOnDrop,
) -> Response {
    let (mut text, mut tokens, mut lps) = (String::new(), Vec::new(), Vec::new());
    let mut want_lps = false;
    while let Some(e) = events.recv().await {
        match e {
            Event::Token(t) => {
                text += &t.text;
                tokens.push(t.token);
                if let Some(lp) = t.logprob {
                    want_lps = true;
                    lps.push(lp);
                }
            }
            Event::Done {
                text: rest,
                finish,
                usage,
            } => {
                guard.done = true;
                text += &rest;
                let lp = match want_lps {
                    true => logprobs_of(&s, &tokens, &lps),
                    false => Value::Null,
                };
                let mut body = completion(&s, &name, &text, Some(finish), lp);
                body["usage"] = json!({
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                });
                return Json(body).into_response();
            }
            Event::Failed(m) => {
                guard.done = true;
                return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m);
            }
        }
    }
    guard.done = true;
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        RequestError::Stopped.to_string(),
    )
}

/// A completion object (OpenAI's legacy shape): the whole answer, or
/// one streamed chunk of it.
fn completion(s: &AppState, name: &str, text: &str, finish: Option<Finish>, lp: Value) -> Value {
    json!({
        "id": name,
        "object": "text_completion",
        "created": now(),
        "model": s.model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish.map(Finish::as_str),
        }],
    })
}

/// One streamed chunk.
fn chunk(s: &AppState, name: &str, text: &str, finish: Option<Finish>, lp: Value) -> SseEvent {
    SseEvent::default().data(completion(s, name, text, finish, lp).to_string())
}

fn streamed(
    s: Arc<AppState>,
    name: String,
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    // The guard lives in the stream: a client that goes away drops it.
    let state = (events, guard, false);
    let stream = futures_util::stream::unfold(state, move |(mut events, mut guard, ended)| {
        let s = s.clone();
        let name = name.clone();
        async move {
            if ended {
                return None;
            }
            let ev = match events.recv().await {
                Some(Event::Token(t)) => {
                    let lp = match t.logprob {
                        Some(lp) => logprobs_of(&s, &[t.token], &[lp]),
                        None => Value::Null,
                    };
                    chunk(&s, &name, &t.text, None, lp)
                }
                Some(Event::Done { text, finish, .. }) => {
                    guard.done = true;
                    let last = chunk(&s, &name, &text, Some(finish), Value::Null);
                    return Some((Ok(last), (events, guard, true)));
                }
                Some(Event::Failed(m)) => {
                    guard.done = true;
                    let body = json!({"error": {"message": m, "type": "server_error"}});
                    let last = SseEvent::default().data(body.to_string());
                    return Some((Ok(last), (events, guard, true)));
                }
                // The engine dropped the request (it stopped).
                None => return None,
            };
            Some((Ok(ev), (events, guard, false)))
        }
    });
    let done = futures_util::stream::once(async { Ok(SseEvent::default().data("[DONE]")) });
    use futures_util::StreamExt;
    Sse::new(stream.chain(done))
}

/// Serves the API on `listener` until `shutdown` resolves (requests in
/// flight finish first). Every connection is set to send small writes at
/// once (`TCP_NODELAY`): a stream's first token is a small write right
/// after the response's headers, and Nagle's algorithm would hold it until
/// the client acknowledged them — up to 40 ms of delayed ACK added to
/// every time to first token.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        // Only latency is at stake if the option cannot be set.
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_is_429_a_stopped_engine_503_the_rest_400() {
        assert_eq!(refused(RequestError::Busy(3)).status(), 429);
        assert_eq!(refused(RequestError::Stopped).status(), 503);
        assert_eq!(refused(RequestError::EmptyPrompt).status(), 400);
        assert_eq!(
            refused(RequestError::TooBig {
                needed: 9,
                blocks: 4
            })
            .status(),
            400
        );
    }
}
