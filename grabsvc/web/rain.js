// The red-packet rain: packets fall on a canvas; tapping one (or the "Grab a packet"
// button, from the keyboard) is a real POST /v1/grab for the player. Every amount
// shown comes from the grab service's answer. GET /v1/activity is polled at most
// once a second for the name, the window and the packets left.
'use strict';
(function () {
  var $ = function (id) { return document.getElementById(id); };
  var canvas = $('rain');
  var g = canvas.getContext('2d');
  var query = new URLSearchParams(location.search);
  var fragment = new URLSearchParams(location.hash.slice(1));
  var token = fragment.get('token') || '';
  var reduced = window.matchMedia('(prefers-reduced-motion: reduce)');

  // ---- the player ----------------------------------------------------------
  var USER_KEY = 'redpacket.userId';
  function load() { try { return localStorage.getItem(USER_KEY) || ''; } catch (e) { return ''; } }
  function save(v) { try { localStorage.setItem(USER_KEY, v); } catch (e) { /* private mode */ } }
  function guest() {
    var b = new Uint8Array(5);
    crypto.getRandomValues(b);
    return 'guest-' + Array.prototype.map.call(b, function (x) { return (x + 256).toString(16).slice(1); }).join('');
  }
  var user = (query.get('user') || '').trim().slice(0, 128) || load() || guest();
  save(user);
  var input = $('user');
  input.value = user;
  input.addEventListener('change', function () {
    var v = input.value.trim();
    if (v) { user = v; save(v); } else { input.value = user; }
  });

  // ---- the activity --------------------------------------------------------
  var activity = null;
  var skew = 0; // server clock minus this clock, when they differ by more than 2 s
  var PHASES = {
    Pending: 'Getting ready', Seeding: 'Getting ready', Scheduled: 'Starting soon', Active: 'Live',
    Paused: 'Paused', Exhausted: 'Sold out', Expired: 'Ended'
  };
  function number(n) { return Number(n).toLocaleString(); }
  function money(minor, currency) {
    try {
      var f = new Intl.NumberFormat(undefined, { style: 'currency', currency: currency, currencyDisplay: 'narrowSymbol' });
      return f.format(minor / Math.pow(10, f.resolvedOptions().maximumFractionDigits));
    } catch (e) {
      return (minor / 100).toFixed(2) + ' ' + currency;
    }
  }
  function poll() {
    var next = 1000;
    // With a start spread, the answer carries this player's own opening instant.
    // The path is relative to the page, so a gateway's prefix is kept.
    fetch('v1/activity?userId=' + encodeURIComponent(user), { cache: 'no-store', headers: { Accept: 'application/json' } })
      .then(function (r) {
        var d = Date.parse(r.headers.get('Date') || '');
        if (d) { var s = d + 500 - Date.now(); skew = Math.abs(s) > 2000 ? s : 0; }
        if (r.status === 429) { next = 1000 * Math.max(1, Number(r.headers.get('Retry-After')) || 1); }
        if (!r.ok) { return null; }
        return r.json();
      })
      .then(function (a) { if (a) { activity = a; showActivity(); } })
      .catch(function () { $('phase').textContent = 'reconnecting'; })
      .then(function () { setTimeout(poll, document.hidden ? 5000 : next); });
  }
  function showActivity() {
    var a = activity;
    $('name').textContent = a.name;
    document.title = a.name + ' · Red-packet rain';
    var phase = $('phase');
    phase.textContent = PHASES[a.phase] || a.phase;
    phase.dataset.phase = a.phase;
    $('left').textContent = number(a.remainingCount) + ' / ' + number(a.count);
    tick();
  }
  function clock(ms) {
    var s = Math.max(0, Math.ceil(ms / 1000));
    var d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
    var two = function (n) { return (n < 10 ? '0' : '') + n; };
    var hms = (h || d ? two(h) + ':' : '') + two(m) + ':' + two(s % 60);
    return d ? d + 'd ' + hms : hms;
  }
  function tick() {
    if (!activity) { return; }
    var now = Date.now() + skew;
    var opens = activity.opensAt || activity.startTime;
    var start = opens ? Date.parse(opens) : 0;
    var end = activity.endTime ? Date.parse(activity.endTime) : 0;
    var label = 'Time left', value;
    if (start && now < start) { label = 'Starts in'; value = clock(start - now); }
    else if (end) { value = now < end ? clock(end - now) : 'Ended'; }
    else { value = 'No limit'; }
    $('clock-label').textContent = label;
    $('clock').textContent = value;
  }
  setInterval(tick, 250);

  // ---- grabbing ------------------------------------------------------------
  var busy = false;
  function show(kind, outcome, message, amount, detail) {
    var card = $('card');
    card.dataset.kind = kind;
    card.dataset.outcome = outcome;
    $('message').textContent = message;
    $('amount').textContent = amount || '';
    $('detail').textContent = detail || '';
  }
  var MESSAGES = {
    sold_out: 'Sold out: every packet has been claimed.',
    not_started: 'Not started yet. Wait for the countdown, then tap again.',
    ended: 'The activity has ended.',
    paused: 'The activity is paused. Try again in a moment.',
    unavailable: 'We could not confirm your grab: it may have gone through. Tap again to see your packet.',
    unauthorized: 'Your sign-in link is not valid. Ask for a new one.',
    invalid_request: 'Your player id was refused. Change it below and tap again.'
  };
  function answer(status, retry, b, at) {
    var currency = (activity && activity.currency) || 'CNY';
    var outcome = b.outcome || '';
    if ((outcome === 'granted' || outcome === 'already_claimed') && typeof b.amount === 'number') {
      var amount = money(b.amount, currency);
      if (outcome === 'granted') {
        show('win', outcome, 'You grabbed a red packet!', amount, 'Packet #' + b.packetId + ' for ' + user);
        if (at) { float(at.x, at.y, '+' + amount); }
      } else {
        show('win', outcome, 'Already claimed: one packet per player.', amount, 'Your packet #' + b.packetId);
      }
      return;
    }
    if (outcome === 'rate_limited') {
      show('bad', outcome, 'Too many taps. Wait ' + (Number(retry) || 1) + ' s and try again.');
      return;
    }
    if (MESSAGES[outcome]) {
      show(outcome === 'sold_out' || outcome === 'ended' ? 'over' : 'bad', outcome, MESSAGES[outcome], '', b.error);
      return;
    }
    show('bad', 'unknown', 'Unexpected answer from the grab service (HTTP ' + status + ').');
  }
  function grab(at) {
    if (busy) { return; }
    busy = true;
    show('wait', 'pending', 'Opening…');
    var headers = { 'Content-Type': 'application/json' };
    if (token) { headers.Authorization = 'Bearer ' + token; }
    fetch('v1/grab', { method: 'POST', headers: headers, cache: 'no-store', body: JSON.stringify({ userId: user }) })
      .then(function (r) {
        return r.json().catch(function () { return {}; }).then(function (b) {
          answer(r.status, r.headers.get('Retry-After'), b, at);
        });
      })
      .catch(function () { show('bad', 'offline', 'No connection to the grab service. Nothing was claimed; tap again.'); })
      .then(function () { busy = false; });
  }

  // ---- the rain ------------------------------------------------------------
  var W = 0, H = 0, dpr = 1;
  var drops = [], sparks = [], labels = [];
  var sprite = makeSprite();
  var wanted = Number(query.get('drops'));
  function target() {
    if (wanted >= 1) { return Math.min(200, Math.floor(wanted)); }
    return Math.max(16, Math.min(40, Math.round(W * H / 18000)));
  }
  function makeSprite() {
    var c = document.createElement('canvas');
    var w = 120, h = 160, x = c.getContext('2d');
    c.width = w; c.height = h;
    var body = new Path2D();
    if (body.roundRect) { body.roundRect(4, 4, w - 8, h - 8, 16); } else { body.rect(4, 4, w - 8, h - 8); }
    var red = x.createLinearGradient(0, 0, w, h);
    red.addColorStop(0, '#ff4a45');
    red.addColorStop(0.55, '#d8232a');
    red.addColorStop(1, '#a50f1a');
    x.fillStyle = red;
    x.fill(body);
    x.save();
    x.clip(body);
    x.beginPath();
    x.moveTo(0, 0); x.lineTo(w, 0); x.lineTo(w, h * 0.3);
    x.quadraticCurveTo(w / 2, h * 0.56, 0, h * 0.3);
    x.closePath();
    x.fillStyle = '#b5121d';
    x.shadowColor = 'rgba(60,0,8,0.55)'; x.shadowBlur = 8; x.shadowOffsetY = 4;
    x.fill();
    x.restore();
    x.lineWidth = 4;
    x.strokeStyle = '#ffd66b';
    x.stroke(body);
    var gold = x.createRadialGradient(w / 2 - 6, h * 0.42 - 6, 2, w / 2, h * 0.42, 24);
    gold.addColorStop(0, '#fff3c4');
    gold.addColorStop(0.6, '#ffd66b');
    gold.addColorStop(1, '#d99a1e');
    x.beginPath(); x.arc(w / 2, h * 0.42, 22, 0, Math.PI * 2);
    x.fillStyle = gold; x.fill();
    x.lineWidth = 3; x.strokeStyle = '#b57a12'; x.stroke();
    x.fillStyle = '#b5121d';
    x.fillRect(w / 2 - 6, h * 0.42 - 6, 12, 12);
    return c;
  }
  function spawn(d, anywhere) {
    var size = 34 + Math.random() * 38; // width in CSS pixels
    var angle = (Math.random() - 0.5) * 0.7; // the direction of the fall
    d.w = size; d.h = size * 4 / 3;
    d.vy = (70 + Math.random() * 120) * (0.6 + size / 90);
    d.vx = d.vy * Math.tan(angle);
    d.rot = angle * 0.8 + (Math.random() - 0.5) * 0.4;
    d.spin = (Math.random() - 0.5) * 1.2;
    d.sway = Math.random() * Math.PI * 2;
    d.x = Math.random() * W;
    d.y = anywhere ? Math.random() * (H + d.h) - d.h : -d.h - Math.random() * H * 0.25;
    d.alpha = 0.7 + size / 240;
    return d;
  }
  function resize() {
    dpr = Math.min(2, window.devicePixelRatio || 1);
    W = window.innerWidth; H = window.innerHeight;
    canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr);
    var n = target();
    while (drops.length < n) { drops.push(spawn({}, true)); }
    drops.length = n;
    drops.sort(function (a, b) { return a.w - b.w; }); // small ones behind
    canvas.dataset.drops = String(n);
  }
  window.addEventListener('resize', resize);
  resize();

  function step(dt) {
    var slow = reduced.matches ? 0.12 : 1;
    for (var i = 0; i < drops.length; i++) {
      var d = drops[i];
      d.y += d.vy * dt * slow;
      d.x += d.vx * dt * slow;
      if (!reduced.matches) {
        d.rot += d.spin * dt * 0.3;
        d.sway += dt * 1.6;
        d.x += Math.sin(d.sway) * 12 * dt;
      }
      if (d.y - d.h > H || d.x < -d.w * 2 || d.x > W + d.w * 2) { spawn(d, false); }
    }
    sparks = sparks.filter(function (s) { s.t += dt; return s.t < 0.7; });
    labels = labels.filter(function (l) { l.t += dt; return l.t < 1.6; });
  }
  function draw() {
    g.setTransform(1, 0, 0, 1, 0, 0);
    g.clearRect(0, 0, canvas.width, canvas.height);
    for (var i = 0; i < drops.length; i++) {
      var d = drops[i], c = Math.cos(d.rot) * dpr, s = Math.sin(d.rot) * dpr;
      g.globalAlpha = d.alpha;
      g.setTransform(c, s, -s, c, d.x * dpr, d.y * dpr);
      g.drawImage(sprite, -d.w / 2, -d.h / 2, d.w, d.h);
    }
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.fillStyle = '#ffd66b';
    sparks.forEach(function (p) {
      var k = p.t / 0.7;
      g.globalAlpha = 1 - k;
      g.beginPath();
      g.arc(p.x + Math.cos(p.a) * p.v * k, p.y + Math.sin(p.a) * p.v * k, 3 * (1 - k) + 1, 0, Math.PI * 2);
      g.fill();
    });
    g.font = '800 28px system-ui, sans-serif';
    g.textAlign = 'center';
    labels.forEach(function (l) {
      g.globalAlpha = Math.min(1, 2 * (1 - l.t / 1.6));
      g.lineWidth = 4; g.strokeStyle = '#6b0b12';
      var y = l.y - (reduced.matches ? 0 : l.t * 50);
      g.strokeText(l.text, l.x, y);
      g.fillText(l.text, l.x, y);
    });
    g.globalAlpha = 1;
  }
  function burst(x, y) {
    if (reduced.matches) { return; }
    for (var i = 0; i < 14; i++) { sparks.push({ x: x, y: y, a: i / 14 * Math.PI * 2, v: 40 + Math.random() * 40, t: 0 }); }
  }
  function float(x, y, text) {
    labels.push({ x: Math.min(Math.max(x, 70), W - 70), y: Math.max(y, 40), text: text, t: 0 });
  }
  var last = 0;
  function frame(t) {
    var dt = last ? Math.min(0.05, (t - last) / 1000) : 0;
    last = t;
    step(dt);
    draw();
    requestAnimationFrame(frame);
  }
  requestAnimationFrame(frame);

  // The topmost packet under a point, with some slack for fingers.
  function hit(x, y, slack) {
    for (var i = drops.length - 1; i >= 0; i--) {
      var d = drops[i], c = Math.cos(d.rot), s = Math.sin(d.rot);
      var dx = x - d.x, dy = y - d.y;
      if (Math.abs(dx * c + dy * s) <= d.w / 2 + slack && Math.abs(-dx * s + dy * c) <= d.h / 2 + slack) { return d; }
    }
    return null;
  }
  function take(d) {
    var at = { x: d.x, y: d.y };
    burst(at.x, at.y);
    spawn(d, false);
    grab(at);
  }
  canvas.addEventListener('pointerdown', function (e) {
    var d = hit(e.clientX, e.clientY, e.pointerType === 'mouse' ? 4 : 14);
    if (d) { e.preventDefault(); take(d); }
  });
  // The keyboard's way in: the packet nearest the middle of the screen.
  $('grab').addEventListener('click', function () {
    var best = null, bd = Infinity;
    drops.forEach(function (d) {
      var k = Math.pow(d.x - W / 2, 2) + Math.pow(d.y - H / 2, 2);
      if (d.y > 0 && d.y < H && k < bd) { best = d; bd = k; }
    });
    if (best) { take(best); } else { grab({ x: W / 2, y: H / 2 }); }
  });

  // For automation: where the packets are now, in CSS pixels.
  window.redPacketRain = Object.freeze({
    drops: function () { return drops.map(function (d) { return { x: d.x, y: d.y, w: d.w, h: d.h }; }); }
  });

  poll();
})();
