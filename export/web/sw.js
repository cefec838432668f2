// doel's service worker: makes the page cross-origin isolated where the host cannot send the
// headers itself (GitHub Pages, most free static hosts). A browser gives WebAssembly threads
// (SharedArrayBuffer) only to an isolated page, so without this the model runs on one thread
// there. Every response of this origin is passed on with the two headers added; nothing else is
// changed or kept (the weights' caching is the worker's, in Cache Storage). Written by
// doel-export --web; index.html registers it and reloads once.
"use strict";

self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));

self.addEventListener("fetch", (event) => {
  const req = event.request;
  if (new URL(req.url).origin !== self.location.origin) return; // others' files: untouched
  if (req.cache === "only-if-cached" && req.mode !== "same-origin") return;
  event.respondWith(
    fetch(req).then((resp) => {
      if (resp.status === 0) return resp; // opaque: its headers cannot be read or set
      const headers = new Headers(resp.headers);
      headers.set("Cross-Origin-Opener-Policy", "same-origin");
      headers.set("Cross-Origin-Embedder-Policy", "require-corp");
      return new Response(resp.body, {
        status: resp.status,
        statusText: resp.statusText,
        headers,
      });
    }),
  );
});
