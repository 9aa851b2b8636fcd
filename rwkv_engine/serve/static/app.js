"use strict";
// The chat page of `rwkv-engine serve`: a client of the server's own /v1/chat/completions.
//
// The conversation lives in this page and is sent whole with every message, so the server's
// prompt cache resumes from the part it has already seen. Replies are streamed (server-sent
// events read from fetch's body stream); Stop aborts the fetch, and the server cancels a request
// whose client goes away. Text from the model or the server only ever reaches the page through
// textContent, never as HTML. When the API answers 401 (the server runs with --api-key), the page
// asks for the key, keeps it in sessionStorage and sends it as a Bearer token.
//
// With a reasoning model's template (the server's /v1/models says so in meta.reasoning) the page
// shows a Think toggle, set to the server's default, and sends reasoning_effort "medium" or
// "none" with every message; a reply's reasoning_content streams into a collapsed "Thinking"
// section above its answer. Old thoughts are not sent back (the template would drop them).

const $ = (id) => document.getElementById(id);
const SETTINGS = ["temperature", "top_p", "max_tokens", "presence_penalty", "frequency_penalty", "seed"];
const KEY_ITEM = "rwkv-engine.api-key";

let model = null;      // the served model id, from GET v1/models
let chat = { turns: [] };  // the finished turns of this conversation, [{role, content}]; New chat replaces it
let running = null;    // the AbortController of the reply being streamed, or null
let keyPrompt = null;  // the key dialog's pending answer, shared by requests that got 401 meanwhile
let memoryKey = null;  // the API key where sessionStorage is not available

// --- the API key ------------------------------------------------------------------------------

function getKey() {
  try { return sessionStorage.getItem(KEY_ITEM); } catch { return memoryKey; }
}

function setKey(key) {
  memoryKey = key;
  try {
    if (key === null) sessionStorage.removeItem(KEY_ITEM); else sessionStorage.setItem(KEY_ITEM, key);
  } catch { /* no sessionStorage (e.g. disabled): memory only */ }
}

// Asks for the key; resolves to it, or to null when the user cancels.
function askKey(refused) {
  const dialog = $("key-dialog"), form = $("key-form"), input = $("key"), cancel = $("key-cancel");
  $("key-refused").hidden = !refused;
  input.value = "";
  dialog.showModal();
  input.focus();
  return new Promise((resolve) => {
    const done = (key) => {
      form.onsubmit = dialog.oncancel = cancel.onclick = null;
      dialog.close();
      resolve(key);
    };
    form.onsubmit = (e) => { e.preventDefault(); done(input.value.trim() || null); };
    dialog.oncancel = (e) => { e.preventDefault(); done(null); };
    cancel.onclick = () => done(null);
  });
}

// fetch() with the API key. On 401 it asks for a key and tries again; if the user cancels, the
// 401 response is returned.
async function api(path, init = {}) {
  for (;;) {
    const key = getKey();
    const headers = { ...init.headers };
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    if (key) setKey(null);
    keyPrompt ??= askKey(Boolean(key)).finally(() => { keyPrompt = null; });
    const fresh = await keyPrompt;
    if (fresh === null) return response;
    setKey(fresh);
  }
}

// The error of a failed response: the message of the server's JSON error body, else the status.
async function failure(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = `${body.error.message} (HTTP ${response.status})`;
  } catch { /* not JSON */ }
  return new Error(message);
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// --- the server -------------------------------------------------------------------------------

async function loadModel() {
  const response = await api("v1/models");
  if (!response.ok) throw await failure(response);
  const card = (await response.json()).data[0];
  model = card.id;
  $("model").textContent = model;
  const meta = card.meta || {};
  if (meta.reasoning && $("think-toggle").hidden) {
    $("think").checked = Boolean(meta.think);
    $("think-toggle").hidden = false;
  }
}

// The JSON payloads of a server-sent event stream, up to "data: [DONE]". (This server ends every
// event with "\n\n".)
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const data = buffer.slice(0, end).split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5))
          .join("\n");
        buffer = buffer.slice(end + 2);
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// --- settings ---------------------------------------------------------------------------------

// The server's defaults (written into the page by the server) as the placeholders of the fields.
function showDefaults() {
  let defaults = {};
  try {
    defaults = JSON.parse(document.querySelector('meta[name="rwkv-defaults"]').content);
  } catch { /* the page was not served by rwkv-engine: no defaults to show */ }
  for (const [name, value] of Object.entries(defaults)) {
    if ($(name)) $(name).placeholder = String(value);
  }
}

// The sampling fields the user has set. An empty field is not sent: the server's default applies.
function sampling() {
  const fields = {};
  for (const name of SETTINGS) {
    const input = $(name);
    if (input.validity.badInput) throw new Error(`${input.labels[0].textContent}: not a number`);
    if (input.value.trim() !== "") fields[name] = Number(input.value);
  }
  return fields;
}

// --- the conversation -------------------------------------------------------------------------

function nearBottom() {
  const view = $("conversation");
  return view.scrollHeight - view.scrollTop - view.clientHeight < 40;
}

function scrollDown() {
  $("conversation").scrollTop = $("conversation").scrollHeight;
}

function addMessage(role, text) {
  const item = document.createElement("article");
  item.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const note = document.createElement("div");
  note.className = "note";
  // A reply's thought: collapsed above the answer, shown once the model thinks.
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const label = document.createElement("summary");
  label.textContent = "Thinking…";
  const thought = document.createElement("div");
  thought.className = "thought";
  reasoning.append(label, thought);
  item.append(who, reasoning, body, note);
  $("conversation").append(item);
  scrollDown();
  return { item, body, note, reasoning, label, thought };
}

function describe(finish, usage, seconds) {
  const parts = [];
  if (finish === "stopped") parts.push("stopped");
  if (finish === "length") parts.push("cut at max tokens");
  if (usage) {
    parts.push(`${usage.completion_tokens} tokens`);
    if (usage.completion_tokens > 1 && seconds > 0) parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tokens/s`);
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    parts.push(`prompt ${usage.prompt_tokens} tokens` + (cached ? `, ${cached} from the cache` : ""));
  }
  return parts.join(" · ");
}

function setRunning(controller) {
  running = controller;
  $("send").hidden = controller !== null;
  $("stop").hidden = controller === null;
  document.body.dataset.state = controller ? "running" : "idle";
}

// One turn: shows the message, streams the reply into the page and keeps both in the conversation.
// A turn that fails, or is stopped before any text came, is taken back (the message returns to
// the input box); a reply stopped midway is kept as it is.
async function send(text) {
  const controller = new AbortController();
  const turns = chat.turns;
  setRunning(controller);
  showError("");
  const asked = addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.item.classList.add("streaming");
  let content = "", thought = "", finish = null, usage = null, first = null;
  try {
    const fields = sampling();
    if (model === null) await loadModel();
    const system = $("system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...turns, { role: "user", content: text }];
    if (!$("think-toggle").hidden) fields.reasoning_effort = $("think").checked ? "medium" : "none";
    const response = await api("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, messages, stream: true, stream_options: { include_usage: true }, ...fields }),
      signal: controller.signal,
    });
    if (!response.ok) throw await failure(response);
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      const choice = event.choices && event.choices[0];
      if (choice && choice.delta && choice.delta.reasoning_content) {
        first ??= performance.now();
        thought += choice.delta.reasoning_content;
        const stick = nearBottom();
        reply.reasoning.hidden = false;
        reply.thought.textContent = thought;
        if (stick) scrollDown();
      }
      if (choice && choice.delta && choice.delta.content) {
        reply.label.textContent = "Thought";
        first ??= performance.now();
        content += choice.delta.content;
        const stick = nearBottom();
        reply.body.textContent = content;
        if (stick) scrollDown();
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (event.usage) usage = event.usage;
    }
    if (finish === null) throw new Error("the reply ended before it was finished (did the server stop?)");
  } catch (e) {
    if (!controller.signal.aborted || (content === "" && thought === "")) {
      asked.item.remove();
      reply.item.remove();
      if (turns === chat.turns) {
        if (!controller.signal.aborted) showError(e.message);
        if ($("message").value === "") $("message").value = text;
      }
      if (running === controller) setRunning(null);
      return;
    }
    finish = "stopped";
  }
  reply.item.classList.remove("streaming");
  reply.label.textContent = "Thought";
  turns.push({ role: "user", content: text }, { role: "assistant", content });
  reply.note.textContent = describe(finish, usage, first === null ? 0 : (performance.now() - first) / 1000);
  if (running === controller) setRunning(null);
}

function newChat() {
  if (running) running.abort();
  setRunning(null);
  chat = { turns: [] };
  $("conversation").replaceChildren();
  showError("");
  $("message").focus();
}

// --- wiring -----------------------------------------------------------------------------------

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("message").value.trim();
  if (!text || running) return;
  $("message").value = "";
  send(text);
});
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (running) running.abort(); });
$("new-chat").addEventListener("click", newChat);

showDefaults();
if (matchMedia("(max-width: 50rem)").matches) $("settings").open = false;  // a phone: the conversation first
setRunning(null);
$("message").focus();
loadModel().catch((e) => showError(e.message));
