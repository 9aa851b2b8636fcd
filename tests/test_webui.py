"""The web chat page of `rwkv-engine serve`, in a real browser: headless Chromium driven by selenium.

The server runs as in test_serve.py: a subprocess on a tiny random-weight World model. The model
is rigged so that its replies are full of markup: the head rows of the tokens holding '<', '>'
or '&' are doubled, so those tokens win a good part of the draws. Every reply the page shows is then
a test of safe rendering, and the comparisons below fail if the page ever parses model text as
HTML (a "</x>" or "<!" would vanish from the text, or become an element).

The browser tests type into the page as a user would and check what it shows against the API's
own answer: the reply the page streamed must equal, character for character, the non-streamed
reply of /v1/chat/completions to the same messages, sampling settings and seed.

They need Chromium and its driver (Debian: chromium, chromium-driver; .ci/run installs them)
and skip without them. One browser serves all the tests of this file.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from rwkv_engine.sampling_params import SamplingParams
from rwkv_engine.testing import random_state_dict, save_pth
from rwkv_engine.tokenizer.world import load_vocab

from .test_serve import MODEL, Server

httpx = pytest.importorskip("httpx")

API_KEY = "page-key"

CANCELLED = 'rwkv_engine_requests_total{outcome="cancelled"}'
MARKUP_BOOST = 2.0  # the factor on the head rows of markup tokens (3 and more: every reply the same)


def markup_model(path):
    """The tiny World model of test_serve.py with the tokens holding '<', '>' or '&' made likely."""
    sd = random_state_dict(version="5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=3)
    markup = [i for i, t in enumerate(load_vocab()) if t and any(c in t for c in b"<>&") and b"\n" not in t]
    sd["head.weight"][markup] *= MARKUP_BOOST
    return save_pth(sd, path)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return markup_model(tmp_path_factory.mktemp("webui") / f"{MODEL}.pth")


@pytest.fixture(scope="module")
def server(model_path):
    s = Server(model_path, model_path.with_name("server.log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(model_path):
    s = Server(model_path, model_path.with_name("keyed.log"), "--api-key", API_KEY)
    yield s
    s.stop()


def api_reply(server, messages, key=None, **fields) -> str:
    """The reply of /v1/chat/completions, not streamed: what the page must show."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, **fields},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# --- the files, over plain HTTP ------------------------------------------------------------------


def test_page_and_assets_are_served_with_types_and_cache_headers(server, keyed):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert httpx.get(server.url + "/chat").content == page.content
    assert page.headers["cache-control"] == "no-cache" and page.headers["x-content-type-options"] == "nosniff"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp

    # Nothing is loaded from elsewhere: every src/href is relative to the server (or data:).
    links = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert links and all(not re.match(r"[a-z]+://|//", link) for link in links), links
    # The defaults the page shows are the server's.
    meta = re.search(r'<meta name="rwkv-defaults" content="([^"]*)">', page.text).group(1)
    shown = json.loads(meta.replace("&quot;", '"'))
    api = SamplingParams()  # (no sampling flags: the OpenAI API's defaults)
    assert shown == {
        "temperature": api.temperature,
        "top_p": api.top_p,
        "max_tokens": 4096,
        "presence_penalty": api.presence_penalty,
        "frequency_penalty": api.frequency_penalty,
    }

    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{server.url}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == f"{kind}; charset=utf-8"
        assert r.headers["cache-control"] == "no-cache"
        again = httpx.get(f"{server.url}/static/{name}", headers={"If-None-Match": r.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        head = httpx.head(f"{server.url}/static/{name}")
        assert head.status_code == 200 and head.content == b"" and head.headers["etag"] == r.headers["etag"]

    for path in ("/static/index.html", "/static/missing.js", "/static/%2e%2e/app.py", "/static/"):
        r = httpx.get(server.url + path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path

    # With --api-key the page itself needs no key; the API does.
    assert httpx.get(keyed.url + "/").status_code == 200
    assert httpx.get(keyed.url + "/static/app.js").status_code == 200
    assert httpx.get(keyed.url + "/v1/models").status_code == 401


# --- in the browser -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1100,760",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


class Page:
    """The chat page in the browser, driven through its visible controls."""

    def __init__(self, driver, url: str):
        from selenium.webdriver.common.by import By

        self.driver, self.by = driver, By
        driver.get(url)

    def find(self, element_id: str):
        return self.driver.find_element(self.by.ID, element_id)

    def wait(self, condition, timeout: float = 30.0, message: str = ""):
        from selenium.webdriver.support.wait import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(lambda _: condition(), message)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    @property
    def state(self) -> str:
        return self.js("return document.body.dataset.state")

    def ready(self) -> Page:
        self.wait(lambda: self.state == "idle" and self.find("model").text == MODEL, message="the page did not load")
        return self

    def set(self, **fields) -> Page:
        for name, value in fields.items():
            box = self.find(name)
            box.clear()
            box.send_keys(str(value))
        return self

    def type(self, text: str) -> None:
        self.find("message").send_keys(text + "\n")  # Enter sends

    def say(self, text: str) -> str:
        """Sends a message, waits for the whole reply and returns it as shown."""
        n = len(self.replies())
        self.type(text)
        self.wait(lambda: len(self.replies()) == n + 1 and self.state == "idle", message="no reply")
        return self.replies()[-1]

    def replies(self) -> list[str]:
        return self.js("return [...document.querySelectorAll('.message.assistant .text')].map(e => e.textContent)")

    def messages(self) -> list[tuple[str, str]]:
        return [
            tuple(m)
            for m in self.js(
                "return [...document.querySelectorAll('.message')].map("
                "e => [e.classList[1], e.querySelector('.text').textContent])"
            )
        ]

    def notes(self) -> list[str]:
        return self.js("return [...document.querySelectorAll('.message.assistant .note')].map(e => e.textContent)")

    def error(self) -> str:
        return self.js("const e = document.getElementById('error'); return e.hidden ? '' : e.textContent")


def user(text):
    return {"role": "user", "content": text}


def test_streamed_replies_equal_the_api_and_markup_stays_text(browser, server):
    page = Page(browser, server.url + "/").ready()
    settings = dict(seed=7, temperature=0.8, max_tokens=40)
    page.set(**settings)

    first = page.say("Hello! Write me a web page.")
    want = api_reply(server, [user("Hello! Write me a web page.")], **settings)
    assert first == want
    assert page.notes()[-1].startswith("cut at max tokens · 40 tokens")

    # The conversation is resent: the second reply is the API's answer to the whole of it.
    second = page.say("Another one.")
    history = [user("Hello! Write me a web page."), {"role": "assistant", "content": first}, user("Another one.")]
    assert second == api_reply(server, history, **settings)
    assert page.messages() == [
        ("user", "Hello! Write me a web page."),
        ("assistant", first),
        ("user", "Another one."),
        ("assistant", second),
    ]

    # The replies hold markup that HTML would have swallowed ("</x", "<!", "<x"), shown as text:
    # no element inside any message, nothing run.
    assert re.search(r"<[/!A-Za-z]", first + second), (first, second)
    assert page.js("return document.querySelectorAll('#conversation .text *').length") == 0


def test_new_chat_and_system_prompt(browser, server):
    page = Page(browser, server.url + "/chat").ready()
    settings = dict(seed=3, max_tokens=24)
    page.set(**settings)
    page.say("Hi")
    page.find("new-chat").click()
    assert page.messages() == []

    # The new conversation starts from nothing, with the system prompt the user set.
    system = "You answer in HTML. " * 80  # over 256 tokens: a prefill chunk the prompt cache keeps
    page.js("document.getElementById('system').value = arguments[0]", system)  # (typing it takes seconds)
    got = page.say("Hi")
    want = api_reply(server, [{"role": "system", "content": system.strip()}, user("Hi")], **settings)
    assert got == want
    assert want != api_reply(server, [user("Hi")], **settings)  # (the system prompt makes a difference)

    # The next turn resends the conversation as the server rendered it: its prompt cache resumes.
    page.say("More.")
    assert re.search(r"prompt \d+ tokens, \d+ from the cache$", page.notes()[-1]), page.notes()[-1]


def test_stop_cancels_the_request_and_keeps_the_reply_so_far(browser, server):
    page = Page(browser, server.url + "/").ready()
    page.set(seed=0)  # max_tokens left empty: the server's 4096; this reply runs for hundreds of tokens
    before = server.metrics().get(CANCELLED, 0.0)
    # Stop is clicked from inside the page as soon as the reply shows text: the tiny model streams
    # its whole reply (~2000 tokens) in a few seconds, which a WebDriver poll-then-click on a busy
    # machine could miss, finding the button hidden again.
    page.js(
        """const stop = document.getElementById('stop');
        const seen = new MutationObserver(() => {
            const texts = document.querySelectorAll('.message.assistant .text');
            if (texts.length && texts[texts.length - 1].textContent !== '' && !stop.hidden) {
                seen.disconnect();
                stop.click();
            }
        });
        seen.observe(document.body, {subtree: true, childList: true, characterData: true});"""
    )
    page.type("Tell me a long story.")
    page.wait(lambda: page.replies() and page.replies()[-1] != "", message="no text came")
    page.wait(lambda: page.state == "idle", timeout=5, message="Stop did not end the stream")
    shown = page.replies()[-1]
    assert page.notes()[-1] == "stopped"
    # The server saw the disconnect and cancelled the request (it would run to 4096 tokens).
    server.wait_metric(CANCELLED, lambda v: v == before + 1, timeout=5)
    assert not page.find("send").get_attribute("hidden") and page.find("stop").get_attribute("hidden")

    # What was shown is the beginning of the reply the API gives with that seed.
    longer = api_reply(server, [user("Tell me a long story.")], seed=0, max_tokens=60)
    assert longer.startswith(shown) or shown.startswith(longer), (shown, longer)

    # The stopped reply stays in the conversation and is sent with the next message.
    page.set(max_tokens=16)
    got = page.say("Go on.")
    history = [user("Tell me a long story."), {"role": "assistant", "content": shown}, user("Go on.")]
    assert got == api_reply(server, history, seed=0, max_tokens=16)


def test_server_errors_are_shown_and_the_message_kept(browser, server):
    page = Page(browser, server.url + "/").ready()
    page.set(max_tokens=999999)
    page.type("Hello")
    page.wait(lambda: page.error() != "", message="no error shown")
    assert page.error() == "max_tokens is 999999; this server allows at most 4096 (HTTP 400)"
    assert page.messages() == [] and page.find("message").get_property("value") == "Hello"
    assert page.state == "idle"


def test_api_key_is_asked_for_and_sent(browser, keyed):
    page = Page(browser, keyed.url + "/")
    dialog_open = lambda: page.js("return document.getElementById('key-dialog').open")
    page.wait(dialog_open, message="the page did not ask for the API key")
    assert not page.find("key-refused").is_displayed()

    page.find("key").send_keys("wrong\n")
    page.wait(lambda: dialog_open() and page.find("key-refused").is_displayed(), message="a wrong key was taken")
    page.find("key").send_keys(API_KEY + "\n")
    page.ready()
    assert page.js("return sessionStorage.getItem('rwkv-engine.api-key')") == API_KEY

    page.set(seed=5, max_tokens=20)
    assert page.say("Hi") == api_reply(keyed, [user("Hi")], key=API_KEY, seed=5, max_tokens=20)
    browser.execute_script("sessionStorage.clear()")


@pytest.fixture(scope="module")
def thinking(model_path):
    s = Server(model_path, model_path.with_name("thinking.log"), "--chat-template", "g1", "--think", "on")
    yield s
    s.stop()


def test_thinking_toggle_and_collapsed_thought(browser, thinking, server):
    """With a reasoning template the page has a Think toggle (on: the server's --think), streams
    the thought into a collapsed section above the answer, both equal to the API's
    reasoning_content and content; off, no thought. A World server's page has no toggle."""
    page = Page(browser, thinking.url + "/").ready()
    page.wait(lambda: page.find("think-toggle").is_displayed(), message="no Think toggle")
    assert page.find("think").is_selected()
    settings = dict(seed=4, max_tokens=30)
    page.set(**settings)

    def api(effort):
        r = httpx.post(
            thinking.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [user("Why?")], "reasoning_effort": effort, **settings},
            timeout=60,
        )
        return r.json()["choices"][0]["message"]

    answer = page.say("Why?")
    want = api("medium")
    shown = page.js(
        "const d = [...document.querySelectorAll('.message.assistant .reasoning')].pop();"
        "return [d.hidden, d.open, d.querySelector('.thought').textContent, d.querySelector('summary').textContent]"
    )
    assert want["reasoning_content"] and shown == [False, False, want["reasoning_content"], "Thought"]
    assert answer == want["content"]
    assert page.js("return document.querySelectorAll('#conversation .reasoning .thought *').length") == 0

    page.find("new-chat").click()
    page.find("think").click()  # off
    answer = page.say("Why?")
    want = api("none")
    assert want.get("reasoning_content") is None and answer == want["content"]
    assert page.js("return [...document.querySelectorAll('.message.assistant .reasoning')].pop().hidden")

    plain = Page(browser, server.url + "/").ready()
    assert not plain.find("think-toggle").is_displayed()
