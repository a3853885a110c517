// The packet page, /p/{id}: one red packet created at runtime from a budget. "Open"
// is a real POST /v1/packets/{id}/grab for the player; the detail list (who got what,
// in grab order) is GET /v1/packets/{id}, polled every two seconds. Every amount shown
// comes from the grab service's answers. A budget with user tokens needs one for both:
// the link carries it in its fragment (/p/{id}#token=...), which the browser never
// sends to a server, and the page sends it only as an Authorization header.
'use strict';
(function () {
  var $ = function (id) { return document.getElementById(id); };
  // The page is at <prefix>/p/{id}: the prefix is where a gateway publishes the
  // grab service ("" at the root), and the API is under it too.
  var at = location.pathname.match(/^(.*)\/p\/([^/]*)$/) || ['', '', ''];
  var id = decodeURIComponent(at[2]);
  var base = at[1] + '/v1/packets/' + encodeURIComponent(id);
  var query = new URLSearchParams(location.search);
  var hash = location.hash.slice(1);
  var fragment = new URLSearchParams(hash);
  var token = fragment.get('token') || '';
  // A packet's claim secret, when its budget requires one: /p/{id}#<secret>, or
  // secret=<secret> beside a token. Like the token it stays in the fragment, which
  // no request carries, and goes only in the Claim-Secret header.
  var secret = fragment.get('secret') || (hash && hash.indexOf('=') < 0 ? hash : '');
  // headers are a request's headers with the token and the claim secret, when the
  // link carries them.
  function headers(h) {
    if (secret) { h['Claim-Secret'] = secret; }
    if (token) { h.Authorization = 'Bearer ' + token; }
    return h;
  }

  // ---- the player (the same one as the rain page's) -------------------------
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
    if (v) { user = v; save(v); render(); } else { input.value = user; }
  });

  // ---- the packet -----------------------------------------------------------
  var packet = null;
  function money(minor) {
    var currency = (packet && packet.currency) || 'CNY';
    try {
      var f = new Intl.NumberFormat(undefined, { style: 'currency', currency: currency, currencyDisplay: 'narrowSymbol' });
      return f.format(minor / Math.pow(10, f.resolvedOptions().maximumFractionDigits));
    } catch (e) {
      return (minor / 100).toFixed(2) + ' ' + currency;
    }
  }
  function time(s) {
    var d = new Date(s);
    return isNaN(d) ? '' : d.toLocaleTimeString(undefined, { hour: '2-digit', minute: '2-digit', second: '2-digit' });
  }
  // The service names the packet's state (live, exhausted, expired, refunding,
  // refunded); a live packet whose time ran out between two polls shows expired.
  function state(p) {
    var refund = typeof p.refundAmount === 'number' && p.refundAmount > 0 ? money(p.refundAmount) : '';
    switch (p.state) {
      case 'exhausted': return ['gone', 'All opened'];
      case 'refunding': return ['expired', refund ? 'Expired · ' + refund + ' going back to the sender' : 'Expired'];
      case 'refunded': return ['expired', refund ? 'Expired · ' + refund + ' refunded to the sender' : 'Expired'];
      case 'expired': return ['expired', 'Expired'];
    }
    if (p.expired || Date.parse(p.expiresAt) <= Date.now()) { return ['expired', 'Expired']; }
    if (p.remainingCount === 0) { return ['gone', 'All opened']; }
    return ['open', 'Open'];
  }
  function render() {
    var p = packet;
    if (!p) { return; }
    $('from').textContent = 'From ' + p.sender;
    document.title = 'Red packet from ' + p.sender;
    var st = state(p);
    $('state').textContent = st[1];
    $('state').dataset.state = st[0];
    $('summary').textContent = money(p.totalAmount) + ' in ' + p.count + (p.count === 1 ? ' share' : ' shares');
    $('left').textContent = '· ' + p.remainingCount + ' of ' + p.count + ' left';
    var list = $('grabs');
    // The service marks the best luck (the largest share of a packet that is done).
    list.replaceChildren.apply(list, p.grabs.map(function (g) {
      var li = document.createElement('li');
      li.dataset.user = g.userId;
      li.dataset.me = String(g.userId === user);
      li.dataset.best = String(g.bestLuck === true);
      var who = document.createElement('span');
      who.className = 'who';
      who.textContent = g.userId === user ? g.userId + ' (you)' : g.userId;
      var when = document.createElement('span');
      when.className = 'when';
      when.textContent = time(g.at);
      var much = document.createElement('span');
      much.className = 'much';
      much.textContent = money(g.amount);
      li.append(who, when, much);
      return li;
    }));
    $('empty').hidden = p.grabs.length > 0;
  }
  var missing = false;
  function poll() {
    var next = 2000;
    fetch(base, { cache: 'no-store', headers: headers({ Accept: 'application/json' }) })
      .then(function (r) {
        if (r.status === 429) { next = 1000 * Math.max(2, Number(r.headers.get('Retry-After')) || 2); }
        if (r.status === 401) {
          // The same token would be refused again: stop asking.
          missing = true;
          $('from').textContent = 'Red packet';
          $('state').textContent = 'sign-in needed';
          $('state').dataset.state = 'unauthorized';
          show('bad', 'unauthorized', MESSAGES.unauthorized);
          return null;
        }
        if (r.status === 404) {
          missing = true;
          $('from').textContent = 'No such packet';
          $('state').textContent = 'not found';
          $('state').dataset.state = 'missing';
          show('bad', 'not_found', 'This packet does not exist, or it expired and was settled.');
          return null;
        }
        return r.ok ? r.json() : null;
      })
      .then(function (p) { if (p) { packet = p; render(); } })
      .catch(function () { $('state').textContent = 'reconnecting'; })
      .then(function () { if (!missing) { setTimeout(poll, document.hidden ? 6000 : next); } });
  }

  // ---- opening --------------------------------------------------------------
  function show(kind, outcome, message, amount, detail) {
    var card = $('card');
    card.dataset.kind = kind;
    card.dataset.outcome = outcome;
    $('message').textContent = message;
    $('amount').textContent = amount || '';
    $('detail').textContent = detail || '';
  }
  var MESSAGES = {
    sold_out: 'Too late: every share has been opened.',
    expired: 'This packet has expired; what was left went back to the sender.',
    not_found: 'This packet does not exist, or it expired and was settled.',
    unavailable: 'We could not confirm your grab: it may have gone through. Tap again to see your share.',
    unauthorized: 'Your sign-in link is not valid for this packet. Ask for a new one.',
    invalid_request: 'Your name was refused. Change it below and tap again.'
  };
  function answer(status, retry, b) {
    var outcome = b.outcome || '';
    if ((outcome === 'granted' || outcome === 'already_claimed') && typeof b.amount === 'number') {
      var detail = 'Share ' + (b.share + 1) + (packet ? ' of ' + packet.count : '') + ' for ' + user;
      show('win', outcome, outcome === 'granted' ? 'You got' : 'Already opened: you got', money(b.amount), detail);
      return;
    }
    if (outcome === 'rate_limited') {
      show('bad', outcome, 'Too many taps. Wait ' + (Number(retry) || 1) + ' s and try again.');
      return;
    }
    if (MESSAGES[outcome]) {
      show(outcome === 'sold_out' || outcome === 'expired' ? 'over' : 'bad', outcome, MESSAGES[outcome], '', b.error);
      return;
    }
    show('bad', 'unknown', 'Unexpected answer from the grab service (HTTP ' + status + ').');
  }
  var busy = false;
  $('open').addEventListener('click', function () {
    if (busy) { return; }
    busy = true;
    show('wait', 'pending', 'Opening…');
    fetch(base + '/grab', { method: 'POST', headers: headers({ 'Content-Type': 'application/json' }), cache: 'no-store', body: JSON.stringify({ userId: user }) })
      .then(function (r) {
        return r.json().catch(function () { return {}; }).then(function (b) { answer(r.status, r.headers.get('Retry-After'), b); });
      })
      .catch(function () { show('bad', 'offline', 'No connection to the grab service. Nothing was opened; tap again.'); })
      .then(function () {
        busy = false;
        return fetch(base, { cache: 'no-store', headers: headers({ Accept: 'application/json' }) })
          .then(function (r) { return r.ok ? r.json() : null; })
          .then(function (p) { if (p) { packet = p; render(); } }).catch(function () { /* the poll retries */ });
      });
  });

  poll();
})();
